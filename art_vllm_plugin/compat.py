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
