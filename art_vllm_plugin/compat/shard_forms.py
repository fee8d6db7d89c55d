"""The forms a worker's weights take in vLLM, as a streamed full-weight version is staged and
committed shard by shard (`worker/shard_stage.py`, `worker/shard_commit.py`).

Three forms of one layer's weights:
- the *checkpoint* form: Hugging Face tensors, whole (what the trainer streams);
- the *loaded* form: the layer's parameters as vLLM created them, which its weight loaders
  fill from checkpoint tensors, each taking its tensor-parallel slice (`narrow` by the
  parameter's `output_dim`/`input_dim` and the rank) or its experts (EP), fusing q/k/v and
  gate/up. vLLM records it at model load for its layerwise reload
  (`record_metadata_for_reloading`: meta tensors with the parameters' attributes, weight
  loaders included, `LayerReloadingInfo.restore_metadata`);
- the *served* form: what the forward reads after `process_weights_after_loading` (CPU GEMM
  packing, quantization), kept in the same storage across reloads (CUDA graphs hold it).

A worker stages the loaded form (its shard, exactly what its loaders keep) and commits it
either by a copy into the served tensors, where the two forms are the same
(`plain_copy_applies`), or by vLLM's own per-layer rebuild: the layer back to its loaded form
on the meta device, materialised, filled from the staged shard, processed again, the
processed values copied into the served tensors (`rebuild_layer`, the steps of vLLM 0.32's
`_layerwise_process`, fed from the shard instead of from buffered loader calls).
"""

from __future__ import annotations

import copy
from types import MethodType

from art_vllm_plugin.compat import names
from art_vllm_plugin.compat.patching import load

#: Weight processing that leaves an unquantized layer's tensors as loaded on some platforms
#: (CUDA) and packs them on others (CPU): probed per layer (`plain_copy_applies`).
PROBED_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")


def loaded_form(layer) -> dict:
    """The layer's parameters in their loaded form (meta tensors with their attributes), as
    vLLM recorded them at model load; empty for a layer vLLM recorded nothing for."""
    info = load(names.GET_LAYERWISE_INFO)(layer)
    params, _buffers = info.restore_metadata
    return dict(params)


def bind_loaders(tensor, live_layer, shadow_layer):
    """Bind the weight loaders among `tensor`'s attributes to `shadow_layer`: those vLLM
    recorded unbound (`restore_layer_refs`) and those still bound to `live_layer`. First the
    layerwise wrapper goes: vLLM's reload binds the recorded loaded form to the live layer
    and wraps its loaders (`online_process_loader`, which buffers into the live layer's
    reload state and, outside a reload, drops every tensor as excessive loading), and leaves
    both on the record after the reload."""
    for key in ("weight_loader", "_weight_loader"):  # a plain tensor's, a vLLM parameter's
        if callable(tensor.__dict__.get(key)):
            holder = _LoaderHolder(tensor.__dict__[key])
            tensor.__dict__[key] = load(names.GET_ORIGINAL_LOADER)(holder)
    load(names.RESTORE_LAYER_REFS)(tensor, shadow_layer)
    for key, value in list(tensor.__dict__.items()):
        if isinstance(value, MethodType) and value.__self__ is live_layer:
            tensor.__dict__[key] = value.__func__.__get__(shadow_layer)
    return tensor


def vllm_config_context(vllm_config):
    """vLLM's config context (`set_current_vllm_config`), which weight processing reads; a
    commit runs in it with the runner's config, as vLLM's own reloads do."""
    return load(names.SET_CURRENT_VLLM_CONFIG)(vllm_config)


class _LoaderHolder:
    """What `_get_original_loader` reads a loader from (`weight_loader`)."""

    def __init__(self, loader):
        self.weight_loader = loader


def is_attention_layer(layer) -> bool:
    return bool(load(names.IS_DEFERRED_ATTENTION_LAYER)(layer))


def plain_copy_applies(layer, staged: dict) -> tuple[bool, str]:
    """Whether copying the staged loaded-form tensors into `layer`'s served tensors gives what
    vLLM's reload would: (yes or no, why). Yes when every staged tensor has a served tensor of
    its name, shape, dtype and strides, and the layer's weight processing leaves it as loaded:
    it has none (norms, embeddings without a quant method), or an unquantized method whose
    processing, run on a copy of the layer holding meta tensors, sets no attribute and
    replaces no tensor (on CUDA it does nothing; on CPU it packs the GEMM weights, setting
    `cpu_linear`). Quantized methods and attention layers are never a plain copy."""
    if is_attention_layer(layer):
        return False, "attention layer (processed with the model config)"
    for name, tensor in staged.items():
        served = layer._parameters.get(name)
        if served is None:
            return False, f"{name}: no served tensor of that name"
        if (served.shape, served.dtype, served.stride()) != (
            tensor.shape,
            tensor.dtype,
            tensor.stride(),
        ):
            return False, (
                f"{name}: served as {tuple(served.shape)} {served.dtype}, loaded as "
                f"{tuple(tensor.shape)} {tensor.dtype}"
            )
    method = getattr(layer, "quant_method", None)
    if not isinstance(method, load(names.QUANTIZE_METHOD_BASE)):
        return True, "no weight processing"
    kind = type(method).__name__
    if kind not in PROBED_METHODS:
        return False, f"processed by {kind}"
    return _probe(layer, method, staged)


def _probe(layer, method, staged: dict) -> tuple[bool, str]:
    """Run `method`'s processing on a shallow copy of `layer` whose staged tensors are meta
    tensors (no memory, nothing of the live layer or method touched)."""
    import torch

    scratch = object.__new__(type(layer))
    scratch.__dict__ = dict(layer.__dict__)
    scratch._parameters = dict(layer._parameters)
    scratch._buffers = dict(layer._buffers)
    for name, tensor in staged.items():
        scratch._parameters[name] = torch.nn.Parameter(
            torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta"),
            requires_grad=False,
        )
    before = dict(scratch.__dict__)
    params_before = dict(scratch._parameters)
    try:
        copy.copy(method).process_weights_after_loading(scratch)
    except Exception as exc:  # it needs real values: not a plain copy
        return False, f"{type(method).__name__} processing: {type(exc).__name__}"
    changed = sorted(
        k
        for k in scratch.__dict__.keys() | before.keys()
        if k not in ("_parameters", "_buffers") and scratch.__dict__.get(k) is not before.get(k)
    )
    changed += [n for n, p in params_before.items() if scratch._parameters.get(n) is not p]
    if changed:
        return False, f"{type(method).__name__} processing sets {', '.join(changed)}"
    return True, f"{type(method).__name__} processing leaves it as loaded"


def rebuild_layer(layer, staged: dict) -> None:
    """vLLM's per-layer rebuild, fed from the staged shard: the layer back to its loaded form
    (meta), materialised, its buffers given their served values, its parameters the staged
    ones, processed (`process_weights_after_loading`), and the processed values copied into
    the tensors the forward reads (same storage). On failure the layer gets its served
    tensors back (some may hold part of the new values: the caller writes a whole version
    back) and a clean reload state."""
    info = load(names.GET_LAYERWISE_INFO)(layer)
    kernel = load(names.GET_LAYER_PARAMS_BUFFERS)(layer)
    info.kernel_tensors = kernel
    info.kernel_non_persistent_buffers = set(layer._non_persistent_buffers_set)
    served_buffers = dict(kernel[1])
    try:
        load(names.RESTORE_LAYER_ON_META)(layer, info)
        load(names.MATERIALIZE_LAYER)(layer, info)
        for name, buffer in layer._buffers.items():
            old = served_buffers.get(name)
            fresh = buffer is not None and old is not None and old is not buffer
            if fresh and old.shape == buffer.shape:
                buffer.data.copy_(old)
        for name, tensor in staged.items():
            getattr(layer, name).data.copy_(tensor)
        if hasattr(layer, "_already_called_process_weights_after_loading"):
            delattr(layer, "_already_called_process_weights_after_loading")
        method = getattr(layer, "quant_method", None)
        if isinstance(method, load(names.QUANTIZE_METHOD_BASE)):
            method.process_weights_after_loading(layer)
            if hasattr(layer, "update_param_tp_status"):
                layer.update_param_tp_status()
        load(names.COPY_AND_RESTORE_KERNEL_TENSORS)(layer, info)
    except BaseException:
        load(names.PLACE_KERNEL_TENSORS)(layer, info)
        raise
    finally:
        info.reset()
