"""vLLM's layerwise reload, as a full-weight update writes the model in place
(`worker/base_weights.py`).

vLLM 0.32 `model_executor/model_loader/reload/layerwise.py`: `initialize_layerwise_reload`
keeps each layer's tensors the forward reads (`LayerReloadingInfo.kernel_tensors`), puts the
layer back on the meta device and arms it (`can_load()`); the model's own `load_weights`
buffers each layer's weights until all its elements arrived, then materialises, loads and
processes the layer and copies the result into the kept tensors; `finalize_layerwise_reload`
processes what is left. Nothing in vLLM undoes a pass that raised: the layers still armed keep
the failed pass's buffered weights, and the next `initialize_layerwise_reload` skips them
(`if info.can_load(): continue`), so the write that puts the old weights back would process a
half-loaded layer as soon as the two passes together fill it, from a mix of both, and drop
the rest of its old weights as "excessive loading". `abandon_layerwise_reload` is that undo.
vLLM runs its own reloads inside its config context
(`Worker.update_weights`, `start_weight_update`: `set_current_vllm_config`), which weight
processing reads (FP8 MoE kernels, DeepEP all2all set-up).
"""

from __future__ import annotations

from art_vllm_plugin.compat import names
from art_vllm_plugin.compat.patching import load
from art_vllm_plugin.compat.worker import worker_model_runner


def reload_weights_in_place(worker, weights) -> set[str] | None:
    """Write `weights` ((HF name, tensor) pairs) into the worker's model in place, as vLLM's
    `reload.inplace.reload_weights` does for checkpoint-format weights: every layer is
    re-materialised, loaded through the model's own `load_weights` (fused QKV, gate/up,
    tensor-parallel sharding) and processed again (`process_weights_after_loading`: the CPU
    GEMM packing, quantization), with the processed values copied back into the tensors the
    forward (and a captured graph) reads; inside vLLM's config context with the runner's
    config, as vLLM's own reloads run. Not `GPUModelRunner.reload_weights`: that also calls
    `reset_lora_state()`, which would drop every loaded LoRA slot. Returns the names loaded."""
    runner = worker_model_runner(worker)
    model = runner.get_model()
    model_config = runner.vllm_config.model_config
    with load(names.SET_CURRENT_VLLM_CONFIG)(runner.vllm_config):
        try:
            load(names.INITIALIZE_LAYERWISE_RELOAD)(model)
            loaded = model.load_weights(weights)
            load(names.FINALIZE_LAYERWISE_RELOAD)(model, model_config)
        except BaseException:
            abandon_layerwise_reload(model, model_config)
            raise
    return loaded


def abandon_layerwise_reload(model, model_config) -> int:
    """Undo a layerwise reload that raised, so the next one starts clean: every layer still
    armed gets back the tensors the forward reads (`_place_kernel_tensors`, as vLLM's finalize
    does for a layer that loaded nothing) and its reload state is reset; then vLLM's finalize,
    with nothing armed, only closes the pass (the torchao flag it set aside, the layers it
    tracked as loading). Layers processed before the failure keep what they were written: the
    write that follows rewrites every layer. Returns how many layers were put back."""
    info_of = load(names.GET_LAYERWISE_INFO)
    place_kernel_tensors = load(names.PLACE_KERNEL_TENSORS)
    put_back = 0
    for layer in model.modules():
        info = info_of(layer)
        if not info.can_load():
            continue
        if info.kernel_tensors is not None:
            place_kernel_tensors(layer, info)
            put_back += 1
        info.reset()
    load(names.FINALIZE_LAYERWISE_RELOAD)(model, model_config)
    return put_back
