"""The vLLM version gate and every private vLLM name the plugin touches.

Why: the plugin patches vLLM internals (argument parser construction today; engine-core and
worker internals as features arrive). Those names move between minor releases, so they are all
reached through this module: a vLLM bump is one file to audit, and an untested vLLM fails at
plugin load with a message naming the supported range instead of misbehaving mid-request.
"""

from __future__ import annotations

SUPPORTED_VLLM = ("0.32.0", "0.33")  # [min, max)
SUPPORTED_RANGE_TEXT = "vllm >=0.32.0,<0.33"


class UnsupportedVllmVersion(RuntimeError):
    """Raised when the plugin is selected on a vLLM outside the tested range."""


def _release(version: str) -> tuple[int, ...]:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release
    except InvalidVersion as exc:
        raise UnsupportedVllmVersion(
            f"cannot parse vLLM version {version!r}; the art plugin supports {SUPPORTED_RANGE_TEXT}"
        ) from exc


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM outside [SUPPORTED_VLLM); a local suffix such as '+cpu' is ignored."""
    lo, hi = (_release(v) for v in SUPPORTED_VLLM)
    if not (lo <= _release(version) < hi):
        raise UnsupportedVllmVersion(
            f"vLLM {version} is not supported by the art plugin (art-pipeline); tested range is "
            f"{SUPPORTED_RANGE_TEXT}. Install a supported vLLM, or unselect the plugin "
            "(drop `--plugin art` / remove 'art' from VLLM_PLUGINS)."
        )


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def require_supported_vllm() -> str:
    """Check the installed vLLM; returns its version string."""
    version = vllm_version()
    check_vllm_version(version)
    return version


# --- CLI: `vllm serve` parser construction ------------------------------------------------
def engine_args_class():
    """`vllm.engine.arg_utils.EngineArgs`, whose `add_cli_args` builds the serve options."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs


# --- Stat logger plugin base class --------------------------------------------------------
def stat_logger_base():
    """`vllm.v1.metrics.loggers.StatLoggerBase`: vLLM requires stat-logger plugins subclass it."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    return StatLoggerBase


# --- In-flight LoRA updates: EngineCore, worker, LoRA manager --------------------------------
def engine_core_class():
    """`vllm.v1.engine.core.EngineCore`: utility calls are its methods, run between steps."""
    from vllm.v1.engine.core import EngineCore

    return EngineCore


def worker_base_class():
    """`vllm.v1.worker.worker_base.WorkerBase`: `collective_rpc` calls its methods by name."""
    from vllm.v1.worker.worker_base import WorkerBase

    return WorkerBase


def worker_lora_manager(worker):
    """The worker's `LRUCacheWorkerLoRAManager` (`model_runner.lora_manager`)."""
    runner = getattr(worker, "model_runner", None)
    manager = getattr(runner, "lora_manager", None)
    if manager is None:
        raise RuntimeError("LoRA is not enabled on this worker; start vLLM with --enable-lora")
    return manager


def lora_request(**kwargs):
    from vllm.lora.request import LoRARequest

    return LoRARequest(**kwargs)


# --- Response assembly: OpenAI-compatible serving classes -----------------------------------
def serving_completion_class():
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    return OpenAIServingCompletion


def serving_chat_class():
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    return OpenAIServingChat


def replace_lora_path(lora_request, path: str):
    """A copy of a `LoRARequest` (a msgspec Struct) pointing at another path."""
    import msgspec

    return msgspec.structs.replace(lora_request, lora_path=path)


async def call_engine_utility(engine_client, method: str, *args):
    """Run an EngineCore method between engine steps (`AsyncMPClient.call_utility_async`)."""
    return await engine_client.engine_core.call_utility_async(method, *args)


# --- Every DP engine from one API server (`v1/engine/core_client.py`, vLLM 0.32) ----------
# `AsyncMPClient.call_utility_async` reaches `core_engine` (engine 0) only; the DP load-balancing
# client returns the first engine's answer only. `core_engines` holds the ZMQ identity of each
# engine this client manages (`engine_ranks_managed`, their DP ranks), and
# `_call_utility_async(method, *args, engine=identity)` reaches exactly one of them.
def engine_targets(engine_client) -> list[tuple[int, object]]:
    """(dp_rank, engine identity) of every engine this API server manages, engine 0 first."""
    core = engine_client.engine_core
    return list(zip(core.engine_ranks_managed, core.core_engines, strict=True))


async def call_engine_utility_on(engine_client, identity, method: str, *args):
    """Run an EngineCore method on one engine (by identity from `engine_targets`)."""
    return await engine_client.engine_core._call_utility_async(method, *args, engine=identity)


def api_server_count(engine_client) -> int | None:
    """How many API-server processes share these engines (`AsyncMPClient.client_count`);
    None when the client does not say (then assume several)."""
    count = getattr(getattr(engine_client, "engine_core", None), "client_count", None)
    return count if isinstance(count, int) else None


def dp_load_balancing_mode(vllm_config) -> str | None:
    """None without data parallelism; else 'internal', 'external' or 'hybrid'
    (`ParallelConfig.data_parallel_external_lb` / `data_parallel_hybrid_lb`)."""
    parallel = vllm_config.parallel_config
    if parallel.data_parallel_size <= 1:
        return None
    if parallel.data_parallel_external_lb:
        return "external"
    if parallel.data_parallel_hybrid_lb:
        return "hybrid"
    return "internal"


def max_lora_rank(engine_client) -> int:
    return engine_client.vllm_config.lora_config.max_lora_rank


# --- Prefix-cache salting: Request block hashes and the scheduler's waiting queues ----------
def rehash_request_blocks(request) -> None:
    """Recompute a `vllm.v1.request.Request`'s prompt block hashes after its salt changed."""
    request.block_hashes = []
    request.update_block_hashes()


#: The scheduler's queues of requests not yet running, in vLLM 0.32
#: (`v1/core/sched/scheduler.py` `Scheduler.__init__`): `waiting`, and `kv_holding_waiting`
#: (waiting requests that hold KV blocks, drained first). `deferred_waiting` is a set of
#: requests that also sit in one of these two queues, so it is not listed.
WAITING_QUEUES = ("waiting", "kv_holding_waiting")


def waiting_requests(scheduler):
    """Requests in the scheduler's waiting queues (not yet scheduled).

    A missing queue is an error, not an empty queue: a vLLM that renamed one would otherwise
    silently stop re-salting the requests in it."""
    for name in WAITING_QUEUES:
        queue = getattr(scheduler, name, None)
        if queue is None:
            raise RuntimeError(
                f"vLLM scheduler {type(scheduler).__name__} has no waiting queue {name!r}; "
                f"the art plugin supports {SUPPORTED_RANGE_TEXT}"
            )
        yield from list(queue)


def request_state_class():
    """`vllm.v1.engine.output_processor.RequestState`: builds each `CompletionOutput`."""
    from vllm.v1.engine.output_processor import RequestState

    return RequestState


# --- Slot updates in the worker: the LoRA managers' private parts ---------------------------
# vLLM 0.32 `lora/worker_manager.py` (LRUCacheWorkerLoRAManager) and `lora/model_manager.py`
# (LRUCacheLoRAModelManager). A LoRA id's weights come from `_load_adapter(request)` whenever
# the id is not in the CPU cache (`_registered_adapters`); `activate_adapter` copies a
# registered model into a free index of every module's stacked tensors (`set_lora`).
def worker_lora_manager_class():
    """`LRUCacheWorkerLoRAManager`, whose `_load_adapter` reads an adapter from a request."""
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    return LRUCacheWorkerLoRAManager


def adapter_model_manager(worker_manager):
    """The `LRUCacheLoRAModelManager` behind a worker LoRA manager."""
    return worker_manager._adapter_manager


def pin_lora_in_cpu_cache(worker, lora_int_id: int) -> None:
    """Keep a loaded LoRA id in the worker's CPU cache (`_registered_adapters`) for good, but
    not in a device slot: `pin_lora`/`pin_adapter` also pins it in `_active_adapters`, where
    it holds one of the `--max-loras` slots the scheduler counts as free for every batch."""
    adapter_model_manager(worker_lora_manager(worker))._pin_lora_in_cpu_cache(int(lora_int_id))


def load_adapter_files(worker_manager, lora_request):
    """Read an adapter with vLLM's own loader and checks (`_load_adapter`): a CPU LoRAModel."""
    return worker_manager._load_adapter(lora_request)


def original_load_adapter(worker_manager_cls):
    """The unpatched `_load_adapter` of the class (for the plugin's wrapper)."""
    return worker_manager_cls._load_adapter


def set_load_adapter(worker_manager_cls, fn) -> None:
    worker_manager_cls._load_adapter = fn


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


def worker_rank(worker) -> int:
    return int(getattr(worker, "rank", 0))


# --- EngineCore internals for updates and provenance ---------------------------------------
# vLLM 0.32 `v1/engine/core.py`: `_attach_weight_version(outputs)` stamps each step's outputs
# with `_weight_version` when the outputs are made (in `step` and `step_with_batch_queue`),
# right after `scheduler.update_from_output(scheduler_output, ...)`; `model_executor`
# runs worker methods; `batch_queue` holds batches scheduled but not yet returned.
def engine_executor(core):
    return core.model_executor


def engine_scheduler(core):
    return core.scheduler


def engine_batch_queue_size(core) -> int:
    return int(getattr(core, "batch_queue_size", 1) or 1)


def engine_inflight_batches(core) -> int:
    queue = getattr(core, "batch_queue", None)
    return len(queue) if queue is not None else 0


def set_engine_weight_label(core, label: str) -> None:
    """vLLM's own weight-version string (what `get_weight_version` returns)."""
    core._weight_version = label


def engine_weight_label(core) -> str:
    return core._weight_version


def wrap_engine_attach_weight_version(engine_core_cls, make_wrapper) -> None:
    engine_core_cls._attach_weight_version = make_wrapper(engine_core_cls._attach_weight_version)


def set_output_weight_label(outputs, label: str) -> None:
    """Stamp `EngineCoreOutputs.weight_version` of one step's outputs (by client index)."""
    for eco in outputs.values():
        eco.weight_version = label


# --- CPU core layout (EngineCore process) ----------------------------------------------------
def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def engine_core_proc_classes():
    """`EngineCoreProc` and `DPEngineCoreProc` (`vllm/v1/engine/core.py`): each defines the
    `run_busy_loop` its process runs once workers are started and bound."""
    from vllm.v1.engine.core import DPEngineCoreProc, EngineCoreProc

    return (EngineCoreProc, DPEngineCoreProc)


def worker_pids(engine_core) -> list[int]:
    """Pids of the worker processes of a multiprocessing executor (`MultiprocExecutor.workers`
    -> `WorkerProcHandle.proc`); empty for an in-process executor."""
    workers = getattr(engine_core.model_executor, "workers", None) or []
    return [w.proc.pid for w in workers if getattr(w, "proc", None) is not None]


# --- Plugin loading: vLLM's plugin groups (`vllm/plugins/__init__.py`) ------------------------
def plugin_groups() -> tuple[str, str]:
    """(endpoint group, stat-logger group) names."""
    from vllm.plugins import ENDPOINT_PLUGINS_GROUP, STAT_LOGGER_PLUGINS_GROUP

    return ENDPOINT_PLUGINS_GROUP, STAT_LOGGER_PLUGINS_GROUP


def wrap_load_plugins_by_group(make_wrapper, mark: str) -> None:
    """Wrap `vllm.plugins.load_plugins_by_group` where vLLM calls it for the endpoint group
    (`vllm.plugins`, looked up at call time) and the stat-logger group
    (`vllm.v1.metrics.loggers`, bound at import); idempotent through `mark`."""
    import sys

    import vllm.plugins as plugins

    modules = [plugins]
    loggers = sys.modules.get("vllm.v1.metrics.loggers")  # imported later binds the wrapper
    if loggers is not None:
        modules.append(loggers)
    for module in modules:
        original = module.load_plugins_by_group
        if not getattr(original, mark, False):
            wrapper = make_wrapper(original)
            setattr(wrapper, mark, True)
            module.load_plugins_by_group = wrapper


# --- API server: streaming spans (`v1/engine/output_processor.py` RequestState) -------------
def wrap_new_completion_output(request_state_cls, make_wrapper) -> None:
    """Wrap `RequestState._new_completion_output`, which builds every `CompletionOutput`."""
    request_state_cls._new_completion_output = make_wrapper(
        request_state_cls._new_completion_output
    )


def weight_version_spans_so_far(request_state):
    """The request's weight-version spans so far (`_weight_version_spans`), or None if vLLM
    recorded no version start yet (`weight_version_starts`)."""
    if not request_state.weight_version_starts:
        return None
    return request_state._weight_version_spans()


def engine_dead_error_class():
    """`vllm.v1.engine.exceptions.EngineDeadError`: the engine process is gone."""
    from vllm.v1.engine.exceptions import EngineDeadError

    return EngineDeadError


# --- MoE routes (`--art-routes`): native AuxOutput pieces and the V1 CPU runner --------------
def vllm_config_class():
    """`vllm.config.VllmConfig`; `_verify_aux_output_compatibility` refuses AuxOutput (routed
    experts) unless Model Runner V2 serves."""
    from vllm.config import VllmConfig

    return VllmConfig


def routes_use_worker_path(vllm_config) -> bool:
    """True when the V1 runner of the CPU platform serves: the plugin's worker capture fills
    the native routed-experts output there (MRV2, if ever used on CPU, has its own)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu() and not vllm_config.use_v2_model_runner


def cpu_v1_model_runner_class():
    """`vllm.v1.worker.cpu_model_runner.CPUModelRunner` (a V1 `GPUModelRunner`): its
    `execute_model` runs the forward, `sample_tokens` returns the `ModelRunnerOutput`."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    return CPUModelRunner


def aux_request_output(token_start: int, rows):
    """`AuxRequestOutput(token_start, rows)`: what the scheduler's `take_output` slices
    (`distributed/aux_output_connector/connector.py`)."""
    from vllm.distributed.aux_output_connector.connector import AuxRequestOutput

    return AuxRequestOutput(token_start, rows)


def bind_route_capture(model, capture) -> list[int]:
    """Attach `capture(layer_id, topk_ids)` to every MoE router of `model` through vLLM's own
    `bind_routed_experts_capturer` (`fused_moe/routed_experts_capturer.py`; routers call it in
    `BaseRouter.select_experts` with the logical ids, before EPLB mapping). Returns the MoE
    layer ids, ascending."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
        bind_routed_experts_capturer,
    )

    layer_ids = sorted({m.layer_id for m in model.modules() if isinstance(m, MoERunner)})
    bind_routed_experts_capturer(model, capture)
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


def completion_request_class():
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return CompletionRequest


def chat_request_class():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest


def serving_handlers(app_state) -> tuple[object, object]:
    """(completion, chat) serving objects the stock routes use (`app.state`)."""
    return (
        getattr(app_state, "openai_serving_completion", None),
        getattr(app_state, "openai_serving_chat", None),
    )


def num_experts(vllm_config) -> int:
    return vllm_config.model_config.get_num_experts()


# --- Exact leases: LoRA capacity, fresh ids, requests using an id (vLLM 0.32) -----------------
def lora_capacity(vllm_config) -> tuple[int, int]:
    """(`max_loras`, `max_cpu_loras`) of the LoRA config (`max_cpu_loras` defaults to
    `max_loras`, `config/lora.py`)."""
    cfg = vllm_config.lora_config
    return int(cfg.max_loras), int(cfg.max_cpu_loras or cfg.max_loras)


def next_lora_int_id(serving_models) -> int:
    """A fresh LoRA id from the API server's counter (`OpenAIServingModels.lora_id_counter`,
    the one `load_lora_adapter` draws from), so it never collides with vLLM's own ids."""
    return serving_models.lora_id_counter.inc(1)


def scheduler_requests_with_lora(scheduler, lora_int_id: int) -> int:
    """How many unfinished requests (`Scheduler.requests`: waiting, running, in a batch in
    flight) use LoRA id `lora_int_id`."""
    return sum(
        1
        for r in scheduler.requests.values()
        if r.lora_request is not None and r.lora_request.lora_int_id == lora_int_id
    )


# --- LoRA on a MoE model in the CPU build (vLLM 0.32, `fused_moe/oracle/unquantized.py`) -----
# `FusedMoE` builds `FusedMoEConfig(is_lora_enabled=vllm_config.lora_config is not None)`, and
# `select_unquantized_moe_backend` then picks the Triton LoRA experts, which the CPU build lacks.
def fused_moe_config_class():
    """`FusedMoEConfig`; its `__post_init__` runs while the model is built."""
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig

    return FusedMoEConfig


def current_vllm_config_or_none():
    """The config of the model being built (`get_current_vllm_config_or_none`)."""
    from vllm.config.vllm import get_current_vllm_config_or_none

    return get_current_vllm_config_or_none()


def lora_model_manager_class():
    """`LoRAModelManager`; `_validate_moe_lora_format(lora_model)` runs on every adapter read
    by `_load_adapter` (stock loads and the plugin's slot updates alike)."""
    from vllm.lora.model_manager import LoRAModelManager

    return LoRAModelManager


def lora_model_module_names(lora_model) -> list[str]:
    """Module names an adapter carries weights for (`LoRAModel.loras`)."""
    return sorted(lora_model.loras)
