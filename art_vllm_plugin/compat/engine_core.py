"""vLLM names EngineCore code reaches: the engine, its scheduler, executor and step labels.

vLLM 0.32 `v1/engine/core.py`: `_attach_weight_version(outputs)` stamps each step's outputs
with `_weight_version` when the outputs are made (in `step` and `step_with_batch_queue`),
right after `scheduler.update_from_output(scheduler_output, ...)`; `model_executor` runs
worker methods; `batch_queue` holds batches scheduled but not yet returned.
"""

from __future__ import annotations

from art_vllm_plugin.compat import names
from art_vllm_plugin.compat.patching import load
from art_vllm_plugin.compat.versions import SUPPORTED_RANGE_TEXT


def engine_core_class():
    """`vllm.v1.engine.core.EngineCore`: utility calls are its methods, run between steps."""
    return load(names.ENGINE_CORE)


def engine_executor(core):
    return core.model_executor


def engine_scheduler(core):
    return core.scheduler


def freeze_running_requests(core) -> None:
    """What vLLM's `POST /pause?mode=keep&clear_cache=false` does in the engine: the scheduler
    stops stepping, running requests keep their place and KV cache; `POST /resume` undoes it.
    (The returned future, done once the engine is idle, is left alone: nobody waits on it.)"""
    core.pause_scheduler(mode="keep", clear_cache=False)


def engine_paused(core) -> bool:
    """Whether this engine's scheduler is paused (`EngineCore.is_scheduler_paused`): with data
    parallelism vLLM's `GET /is_paused` answers only when every engine agrees."""
    return bool(core.is_scheduler_paused())


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


def set_output_weight_label(outputs, label: str) -> None:
    """Stamp `EngineCoreOutputs.weight_version` of one step's outputs (by client index)."""
    for eco in outputs.values():
        eco.weight_version = label


def worker_pids(engine_core) -> list[int]:
    """Pids of the worker processes of a multiprocessing executor (`MultiprocExecutor.workers`
    -> `WorkerProcHandle.proc`); empty for an in-process executor."""
    workers = getattr(engine_core.model_executor, "workers", None) or []
    return [w.proc.pid for w in workers if getattr(w, "proc", None) is not None]


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


def scheduler_requests_with_lora(scheduler, lora_int_id: int) -> int:
    """How many unfinished requests (`Scheduler.requests`: waiting, running, in a batch in
    flight) use LoRA id `lora_int_id`."""
    return sum(
        1
        for r in scheduler.requests.values()
        if r.lora_request is not None and r.lora_request.lora_int_id == lora_int_id
    )
