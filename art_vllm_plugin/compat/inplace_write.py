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

vLLM 0.34 (`reload/lifecycle.py`): a reload begins with `start_reload(model)` and ends with
`finish_reload(model, model_config, device)`, which pick the mode `VLLM_RELOAD_MODE` selects
and keep the process-wide `weight_update_active()` flag that models' `load_weights` read. In the
default layerwise mode they wrap the same two calls as before, so the undo above still holds
(its closing `finish_reload` also clears the flag). The direct mode writes into the served
tensors with no rollback; the plugin refuses it at start (`refuse_direct_reload`). On 0.34 the
write also runs inside `kv_cache_lent_for_weight_update`, as vLLM's own `reload_weights` does:
an extensible KV cache (CUDA, on by default) caps torch's memory, and a layer rebuild allocates
beyond that cap; the context lifts it (and lends the KV cache's memory when it holds nothing to
keep), or fails before any weight changes when not even the largest layer fits. Without an
extensible KV cache (the CPU platform) the context does nothing.
"""

from __future__ import annotations

import contextlib

from art_vllm_plugin.compat import names
from art_vllm_plugin.compat.patching import load
from art_vllm_plugin.compat.versions import applies
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
    # 0.34's finish_reload takes the model's device (its direct mode needs it).
    device = runner.device if applies(names.FINISH_RELOAD.checked) else None
    with (
        _kv_cache_lent(worker, runner, model),
        load(names.SET_CURRENT_VLLM_CONFIG)(runner.vllm_config),
    ):
        try:
            start_reload(model)
            loaded = model.load_weights(weights)
            finish_reload(model, model_config, device)
        except BaseException:
            abandon_layerwise_reload(model, model_config, device)
            raise
    return loaded


def start_reload(model) -> None:
    """Begin an in-place write: `start_reload` on 0.34, `initialize_layerwise_reload` before."""
    if applies(names.START_RELOAD.checked):
        load(names.START_RELOAD)(model)
    else:
        load(names.INITIALIZE_LAYERWISE_RELOAD)(model)


def finish_reload(model, model_config, device) -> None:
    """Process what is left and end the write (`finish_reload` on 0.34)."""
    if applies(names.FINISH_RELOAD.checked):
        load(names.FINISH_RELOAD)(model, model_config, device)
    else:
        load(names.FINALIZE_LAYERWISE_RELOAD)(model, model_config)


def refuse_direct_reload() -> None:
    """0.34's `VLLM_RELOAD_MODE=direct` writes into the served tensors with no rollback ("the
    next full update repairs it"), which breaks the plugin's contract that a failed update
    leaves the old weights serving. Refused at start, naming the variable."""
    if applies(names.RELOAD_MODE.checked) and load(names.RELOAD_MODE) != "layerwise":
        raise RuntimeError(
            f"VLLM_RELOAD_MODE={load(names.RELOAD_MODE)!r}: the art plugin's full-weight "
            "updates undo a failed write layer by layer, which only the layerwise reload "
            "allows (the direct mode has no rollback); unset VLLM_RELOAD_MODE or set it to "
            "'layerwise'"
        )


def _kv_cache_lent(worker, runner, model):
    """0.34: vLLM's `kv_cache_lent_for_weight_update` around the write, failing before any
    weight changes if even the largest layer's rebuild cannot fit; before 0.34, nothing."""
    if not applies(names.KV_CACHE_LENT_FOR_WEIGHT_UPDATE.checked):
        return contextlib.nullcontext()
    return load(names.KV_CACHE_LENT_FOR_WEIGHT_UPDATE)(
        getattr(runner, "extensible_kv_cache", None),
        model,
        reclaimable=getattr(worker, "_kv_cache_reclaimable", False),
        fail_if_short=True,
    )


def abandon_layerwise_reload(model, model_config, device) -> int:
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
    finish_reload(model, model_config, device)
    return put_back
