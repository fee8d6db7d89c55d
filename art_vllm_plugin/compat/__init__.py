"""Every vLLM name the plugin touches, and every vLLM method it patches: one package.

Why: the plugin reaches into vLLM internals (EngineCore utilities, the scheduler, LoRA
managers, the OpenAI serving classes). Those names move between minor releases, so all of
them are declared and reached here, and nowhere else:

- `versions`: the version gate; an untested vLLM fails at plugin load, naming the range.
- `patches`: every method the plugin wraps and every name it adds onto a vLLM class, each
  with the vLLM range it was checked against; `names`: every other vLLM name it relies on.
  Both are plain data (no vLLM import): `scripts/check_vllm_compat.py` checks them against
  another vLLM, statically (docs/compat.md).
- `patching`: `wrap` / `wrap_instance` / `add` apply a declared patch (idempotent, one
  marker for all; anything undeclared is refused); `attach_state` hangs the plugin's state
  on a vLLM object. Which patches each process role applies, in which order:
  `art_vllm_plugin/install.py`.
- `platform`, `api_server`, `engine_core`, `worker`, `routes`, `provenance`, `step_rides`:
  accessors, by the process role or feature that uses them; re-exported here, so callers write
  `compat.engine_scheduler(core)`.
"""

from __future__ import annotations

from art_vllm_plugin.compat import names, patches
from art_vllm_plugin.compat.api_server import (
    api_server_count,
    call_engine_utility,
    call_engine_utility_on,
    chat_request_class,
    completion_request_class,
    dp_load_balancing_mode,
    engine_dead_error_class,
    engine_targets,
    error_response,
    lora_capacity,
    max_lora_rank,
    next_lora_int_id,
    plugin_groups,
    replace_lora_path,
    serving_handlers,
    serving_models_of,
    stat_logger_base,
    weight_version_spans_so_far,
)
from art_vllm_plugin.compat.declarations import CHECKED_032, VllmName, VllmPatch
from art_vllm_plugin.compat.engine_core import (
    WAITING_QUEUES,
    engine_batch_queue_size,
    engine_core_class,
    engine_executor,
    engine_inflight_batches,
    engine_scheduler,
    engine_weight_label,
    freeze_running_requests,
    rehash_request_blocks,
    scheduler_requests_with_lora,
    set_engine_weight_label,
    set_output_weight_label,
    waiting_requests,
    worker_pids,
)
from art_vllm_plugin.compat.patching import (
    UndeclaredPatch,
    VllmNameTaken,
    add,
    add_all,
    attach_state,
    attached_state,
    is_applied,
    load,
    original_of,
    wrap,
    wrap_instance,
)
from art_vllm_plugin.compat.platform import (
    current_vllm_config_or_none,
    is_cpu_platform,
    lora_request,
    num_experts,
    routes_use_worker_path,
)
from art_vllm_plugin.compat.provenance import (
    is_async_runner_output,
    is_shared_empty_runner_output,
)
from art_vllm_plugin.compat.routes import (
    engine_vllm_config,
    moe_layer_ids,
    output_routed_experts,
    routes_enabled,
    set_output_routed_experts,
    total_layers,
    worker_model,
)
from art_vllm_plugin.compat.step_rides import (
    count_across,
    engine_pipeline_stages,
    engine_will_step,
    engine_worker_count,
    gather_across,
    worker_tp_cpu_group,
)
from art_vllm_plugin.compat.versions import (
    SUPPORTED_RANGE_TEXT,
    SUPPORTED_VLLM,
    UnsupportedVllmVersion,
    check_vllm_version,
    require_supported_vllm,
    vllm_version,
)
from art_vllm_plugin.compat.worker import (
    adapter_model_manager,
    aux_output_metadata,
    aux_request_output,
    bind_route_capture,
    lora_device,
    lora_model_module_names,
    lora_modules,
    lora_slot_index,
    module_lora_weights,
    pack_adapter,
    pin_lora_in_cpu_cache,
    registered_adapter,
    replace_registered_adapter,
    runner_batch,
    runner_kv_layout,
    runner_request_block_ids,
    set_aux_output,
    worker_lora_manager,
    worker_model_runner,
    worker_rank,
)

__all__ = [
    "CHECKED_032",
    "SUPPORTED_RANGE_TEXT",
    "SUPPORTED_VLLM",
    "WAITING_QUEUES",
    "UndeclaredPatch",
    "UnsupportedVllmVersion",
    "VllmName",
    "VllmNameTaken",
    "VllmPatch",
    "adapter_model_manager",
    "add",
    "add_all",
    "api_server_count",
    "attach_state",
    "attached_state",
    "aux_output_metadata",
    "aux_request_output",
    "bind_route_capture",
    "call_engine_utility",
    "call_engine_utility_on",
    "chat_request_class",
    "check_vllm_version",
    "completion_request_class",
    "count_across",
    "current_vllm_config_or_none",
    "dp_load_balancing_mode",
    "engine_batch_queue_size",
    "engine_core_class",
    "engine_dead_error_class",
    "engine_executor",
    "engine_inflight_batches",
    "engine_pipeline_stages",
    "engine_scheduler",
    "engine_targets",
    "engine_vllm_config",
    "engine_weight_label",
    "engine_will_step",
    "engine_worker_count",
    "error_response",
    "freeze_running_requests",
    "gather_across",
    "is_applied",
    "is_async_runner_output",
    "is_cpu_platform",
    "is_shared_empty_runner_output",
    "load",
    "lora_capacity",
    "lora_device",
    "lora_model_module_names",
    "lora_modules",
    "lora_request",
    "lora_slot_index",
    "max_lora_rank",
    "module_lora_weights",
    "moe_layer_ids",
    "names",
    "next_lora_int_id",
    "num_experts",
    "original_of",
    "output_routed_experts",
    "pack_adapter",
    "patches",
    "pin_lora_in_cpu_cache",
    "plugin_groups",
    "registered_adapter",
    "rehash_request_blocks",
    "replace_lora_path",
    "replace_registered_adapter",
    "require_supported_vllm",
    "routes_enabled",
    "routes_use_worker_path",
    "runner_batch",
    "runner_kv_layout",
    "runner_request_block_ids",
    "scheduler_requests_with_lora",
    "serving_handlers",
    "serving_models_of",
    "set_aux_output",
    "set_engine_weight_label",
    "set_output_routed_experts",
    "set_output_weight_label",
    "stat_logger_base",
    "total_layers",
    "vllm_version",
    "waiting_requests",
    "weight_version_spans_so_far",
    "worker_lora_manager",
    "worker_model",
    "worker_model_runner",
    "worker_pids",
    "worker_rank",
    "worker_tp_cpu_group",
    "wrap",
    "wrap_instance",
]
