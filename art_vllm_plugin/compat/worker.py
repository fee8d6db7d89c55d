"""vLLM names worker code reaches: the LoRA managers' private parts and the V1 runner.

vLLM 0.32 `lora/worker_manager.py` (LRUCacheWorkerLoRAManager) and `lora/model_manager.py`
(LRUCacheLoRAModelManager). A LoRA id's weights come from `_load_adapter(request)` whenever
the id is not in the CPU cache (`_registered_adapters`); `activate_adapter` copies a
registered model into a free index of every module's stacked tensors (`set_lora`).
"""

from __future__ import annotations

from art_vllm_plugin.compat import names
from art_vllm_plugin.compat.patching import load
from art_vllm_plugin.compat.routes import moe_layer_ids


def worker_model_runner(worker):
    """The worker's model runner (`Worker.model_runner`), or None before it exists."""
    return getattr(worker, "model_runner", None)


def worker_lora_manager(worker):
    """The worker's `LRUCacheWorkerLoRAManager` (`model_runner.lora_manager`)."""
    manager = getattr(worker_model_runner(worker), "lora_manager", None)
    if manager is None:
        raise RuntimeError("LoRA is not enabled on this worker; start vLLM with --enable-lora")
    return manager


def worker_rank(worker) -> int:
    return int(getattr(worker, "rank", 0))


def worker_device(worker):
    """The device the worker computes on (`Worker.device`), or None before `init_device`."""
    return getattr(worker, "device", None)


def workers_per_engine(worker) -> int:
    """Workers of this worker's engine (tensor x pipeline parallel): more than one means the
    forward runs collectives across them."""
    return int(worker_model_runner(worker).vllm_config.parallel_config.world_size)


def adapter_model_manager(worker_manager):
    """The `LRUCacheLoRAModelManager` behind a worker LoRA manager."""
    return worker_manager._adapter_manager


def pin_lora_in_cpu_cache(worker, lora_int_id: int) -> None:
    """Keep a loaded LoRA id in the worker's CPU cache (`_registered_adapters`) for good, but
    not in a device slot: `pin_lora`/`pin_adapter` also pins it in `_active_adapters`, where
    it holds one of the `--max-loras` slots the scheduler counts as free for every batch."""
    adapter_model_manager(worker_lora_manager(worker))._pin_lora_in_cpu_cache(int(lora_int_id))


def pack_adapter(model_manager, lora_model) -> None:
    """Pack sub-module weights the way registration does (`_create_merged_loras_inplace`);
    idempotent on an already packed model."""
    model_manager._create_merged_loras_inplace(lora_model)


def module_lora_weights(model_manager, lora_model, module_name: str):
    """The `LoRALayerWeights` of `lora_model` for one module (`_get_lora_layer_weights`)."""
    return model_manager._get_lora_layer_weights(lora_model, module_name)


def lora_modules(model_manager) -> dict:
    """Module name -> LoRA layer (`modules`), each with `lora_a_stacked`/`lora_b_stacked`."""
    return model_manager.modules


def lora_slot_index(model_manager, lora_int_id: int) -> int | None:
    """The stacked-tensor index where the id is active (`lora_index_to_id`), or None."""
    ids = model_manager.lora_index_to_id
    return ids.index(lora_int_id) if lora_int_id in ids else None


def registered_adapter(model_manager, lora_int_id: int):
    """The id's LoRAModel in the CPU cache, without touching the LRU order, or None."""
    return model_manager._registered_adapters.cache.get(lora_int_id)


def replace_registered_adapter(model_manager, lora_int_id: int, lora_model) -> bool:
    """Swap the CPU-cache entry of an id already registered; False if it is not cached."""
    cache = model_manager._registered_adapters
    if lora_int_id not in cache:
        return False
    cache[lora_int_id] = lora_model
    return True


def lora_device(model_manager):
    return model_manager.device


def lora_model_module_names(lora_model) -> list[str]:
    """Module names an adapter carries weights for (`LoRAModel.loras`)."""
    return sorted(lora_model.loras)


# --- MoE routes (`--art-routes`): native AuxOutput pieces and the V1 CPU runner --------------
def aux_request_output(token_start: int, rows):
    """`AuxRequestOutput(token_start, rows)`: what the scheduler's `take_output` slices
    (`distributed/aux_output_connector/connector.py`)."""
    return load(names.AUX_REQUEST_OUTPUT)(token_start, rows)


def bind_route_capture(model, capture) -> list[int]:
    """Attach `capture(layer_id, topk_ids)` to every MoE router of `model` through vLLM's own
    `bind_routed_experts_capturer` (`fused_moe/routed_experts_capturer.py`; routers call it in
    `BaseRouter.select_experts` with the logical ids, before EPLB mapping). Returns the MoE
    layer ids, ascending."""
    layer_ids = moe_layer_ids(model)
    load(names.BIND_ROUTED_EXPERTS_CAPTURER)(model, capture)
    return layer_ids


def runner_request_block_ids(runner, req_id: str) -> list[int]:
    """KV block ids of a request in the V1 runner (`requests[req_id].block_ids`, group 0)."""
    return runner.requests[req_id].block_ids[0]


def runner_batch(runner) -> tuple[list[str], object]:
    """(request ids in batch order, computed-token counts at the start of this step): the
    V1 `InputBatch.req_ids` / `num_computed_tokens_cpu`; the batch's tokens are laid out in
    this order (`_prepare_inputs`)."""
    batch = runner.input_batch
    return batch.req_ids, batch.num_computed_tokens_cpu


def runner_kv_layout(runner) -> tuple[int, int, int]:
    """(number of KV cache groups, blocks per group, scheduler block size) of the V1 runner."""
    config = runner.kv_cache_config
    return len(config.kv_cache_groups), config.num_blocks, runner.cache_config.block_size


def aux_output_metadata(scheduler_output):
    """The scheduler's per-step AuxOutput metadata (`requests`: id -> first row to emit)."""
    return getattr(scheduler_output, "aux_output_connector_metadata", None)


def set_aux_output(model_runner_output, outputs: dict) -> None:
    model_runner_output.aux_output_connector_output = outputs


# --- slot writes: vLLM's LoRA layers, as `set_lora` writes them (worker/slot_layout.py) ----
#: Which vLLM `set_lora` a layer runs -> the kind of write the plugin mirrors for it.
_SET_LORA_KINDS = (
    ("linear", names.LINEAR_SET_LORA),
    ("merged", names.MERGED_SET_LORA),
    ("moe", names.MOE_SET_LORA),
    ("moe3d", names.MOE_3D_SET_LORA),
)


def set_lora_kind(module) -> str | None:
    """Which of vLLM's `set_lora` methods the layer runs: "linear" (`BaseLinearLayerWithLoRA`:
    reset, slice for tensor parallelism, copy into `[index, 0]`), "merged" (the same after
    `expand_packed_lora`), "moe" / "moe3d" (`FusedMoEWithLoRA` / `FusedMoE3DWithLoRA`); None
    for any other (embeddings, logits, or a subclass with a `set_lora` of its own)."""
    method = getattr(type(module), "set_lora", None)
    for kind, name in _SET_LORA_KINDS:
        if method is load(name):
            return kind
    return None


def linear_lora_buffers(module) -> tuple[list, list]:
    """(A, B) stacked tensors of a linear LoRA layer, one per slice:
    A `[max_loras, 1, max_rank, in]`, B `[max_loras, 1, out, max_rank]`."""
    return list(module.lora_a_stacked), list(module.lora_b_stacked)


def moe_lora_buffers(module) -> tuple[tuple, tuple, tuple, tuple]:
    """(w13 A, w13 B, w2 A, w2 B) stacked tensors of an expert LoRA layer, each a tuple (w13:
    one per gate/up slice, or one fused); A `[max_loras, experts, max_rank, in]`, B
    `[max_loras, experts, out, max_rank]` (a shared factor has experts = 1)."""
    return (
        tuple(module.w13_lora_a_stacked),
        tuple(module.w13_lora_b_stacked),
        tuple(module.w2_lora_a_stacked),
        tuple(module.w2_lora_b_stacked),
    )


def moe_match_expert_dim(module, tensor, buffer):
    """`FusedMoEWithLoRA._match_expert_dim`: the factor as its buffer's expert dim takes it."""
    return module._match_expert_dim(tensor, buffer)


def moe_rank_shard(module, which: str, tensor):
    """This rank's tensor-parallel shard of one expert factor, by the layer's own slicing:
    `which` is "w13_a", "w13_b", "w2_a" or "w2_b" (`FusedMoEWithLoRA._slice_<which>`)."""
    if which == "w13_a":
        return module._slice_w13_a(tensor)
    if which == "w13_b":
        return module._slice_w13_b(tensor)
    if which == "w2_a":
        return module._slice_w2_a(tensor)
    if which == "w2_b":
        return module._slice_w2_b(tensor)
    raise ValueError(f"unknown expert factor {which!r}")


def moe_enable_index(module, index: int) -> None:
    """Mark stacked index `index` as holding an adapter (`adapter_enabled[index] = 1`, what
    `FusedMoEWithLoRA.set_lora` does after its reset; the expert kernels skip a 0)."""
    module.adapter_enabled[index] = 1


def adapter_is_3d(lora_model) -> bool:
    """Whether an adapter was loaded as 3-D MoE weights (`LoRAModel.is_3d_lora_weight`, stamped
    from its request); False for None."""
    return bool(getattr(lora_model, "is_3d_lora_weight", False))


def served_weights(worker):
    """The served checkpoint's weights as vLLM loaded them at start ((name, tensor) pairs,
    read from the model's files again: `get_all_weights` of the configured loader)."""
    runner = worker_model_runner(worker)
    config = runner.vllm_config
    loader = load(names.GET_MODEL_LOADER)(config.load_config)
    return loader.get_all_weights(config.model_config, runner.get_model())


def cpu_prepacking_experts(method):
    """The CPU experts of a fused-MoE quant method (`moe_kernel.fused_experts`, a
    `CPUUnquantizedExperts`: its processing prepacks w13/w2 for the CPU grouped GEMM), or
    None."""
    experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
    return experts if isinstance(experts, load(names.CPU_UNQUANTIZED_EXPERTS)) else None
