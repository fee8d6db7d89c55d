"""Slot updates ride the engine's step loop: no RPC, no pipeline drain.

Why: a worker RPC (`collective_rpc`) first waits for every batch in flight (the
multiprocessing executor drains its pending futures), so a stage and a commit sent as RPCs
cost two pipeline bubbles per update, and under async scheduling the batch queue runs dry.
Instead EngineCore queues the update's worker work as a *ride*, and the next batch the
scheduler produces carries it (`SchedulerOutput.art_rides`, pickled to every worker with the
batch). Each worker runs it at the start of that step, before the forward, under the weights
lock (`worker/step_rides.py`): the batch is computed on the new weights and every batch
before it on the old ones, in the order the workers receive them, whatever is in flight.

Order of one commit ride:

1. the utility call (`slot_updates.art_commit_lora_update`) checks the update and queues the
   ride; it returns a `Future`, which vLLM answers when it is done (`_invoke_utility_method`);
2. right before the next `schedule()`, the engine side of the commit is applied: version,
   registry, label, re-salted waiting requests. So the batch about to be scheduled is
   stamped with the new label and its prefix-cache lookups use the new salt;
3. the scheduled batch carries the ride to the workers; they swap, agree across ranks
   (all or nothing, before the forward) and report the outcome with the step's output;
4. when that output comes back (`update_from_output`), the Future is answered. A failure
   puts the engine side back (label, version, registry, salts) and corrects the labels of
   the batches stamped since (they ran on the old weights, which is what the workers
   report).

When the engine will not step (no requests, or paused) the queued rides go to the workers as
one RPC at once (`flush`), with the same worker code: nothing is in flight then, so nothing
is drained. The busy loop flushes too if the requests went away between the utility call and
the next step, so no update waits for a step that never comes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from art_vllm_plugin import compat
from art_vllm_plugin.engine_core.state import EngineCoreState, engine_state
from art_vllm_plugin.worker.forward_labels import RIDES_ATTR, ride_results_of
from art_vllm_plugin.worker.step_rides import (
    ABORT,
    BASE_COMMIT,
    BASE_STAGE,
    COMMIT,
    FINAL,
    STAGE,
)

__all__ = [
    "ABORT",
    "BASE_COMMIT",
    "BASE_STAGE",
    "COMMIT",
    "FINAL",
    "STAGE",
    "Ride",
    "queue",
    "rides_enabled",
]

logger = logging.getLogger(__name__)


@dataclass
class Ride:
    """One piece of worker work for the next step. `before_step` runs on the busy loop right
    before the batch that carries it is scheduled; `settle(result)` gets the workers'
    engine-wide result (None for a stage) and returns what the Future is answered with."""

    kind: str
    token: str
    args: tuple
    before_step: Callable[[], None] | None = None
    settle: Callable[[dict | None], object] | None = None
    future: Future = field(default_factory=Future)

    def wire(self) -> tuple:
        return (self.kind, self.token, self.args)


def rides_enabled(core) -> bool:
    """Rides need the stamped scheduler (it attaches them) and one pipeline stage (every
    worker then runs each step's `execute_model` before its forward). With pipeline stages
    the rides go as an RPC at once (`flush`), which the executor orders after the batches in
    flight, and every worker's answer comes back (`engine_results`)."""
    return engine_state(core).stamps.scheduler_stamped and compat.engine_pipeline_stages(core) == 1


def queue(core, ride: Ride) -> Future:
    """Queue `ride` for the next step, or run it at once when the engine will not step."""
    state = engine_state(core)
    state.rides.pending.append(ride)
    if not (rides_enabled(core) and compat.engine_will_step(core)):
        flush(core, state)
    return ride.future


def drop(core, token: str) -> bool:
    """Forget queued rides of `token` (an aborted update) that no batch carries yet. True if
    none was queued: the workers may have its stage (it rode a batch or an RPC)."""
    rides = engine_state(core).rides
    kept = [r for r in rides.pending if r.token != token]
    sent = len(kept) == len(rides.pending)
    rides.pending = kept
    return sent


def flush(core, state: EngineCoreState) -> None:
    """Send the queued rides as one RPC (nothing in flight to drain: the engine is idle)."""
    rides, state.rides.pending = state.rides.pending, []
    if not rides:
        return
    state.rides.flushed += len(rides)
    for ride in rides:
        if ride.before_step is not None:
            ride.before_step()
    try:
        results = compat.engine_executor(core).collective_rpc(
            "art_run_rides", args=([r.wire() for r in rides],)
        )
    except Exception as exc:
        # Whether the workers swapped is unknown: a commit is answered so (its slot is
        # blocked), and the caller learns of the error (a utility call fails with it).
        _settle(rides, [_unknown(r, f"the workers' RPC failed: {exc}") for r in rides])
        raise
    _settle(rides, engine_results(rides, results))


def engine_results(rides: list[Ride], per_worker: list[list]) -> list:
    """One result per ride from every worker's results (`collective_rpc` answers one list per
    worker), not from worker 0's alone: the workers agree on a commit before they answer
    (`worker/engine_agreement.py`), so their results are equal; if they were not, the
    engine's outcome is not known, and a commit is answered so (its weights unrestored:
    the slot is blocked) rather than as worker 0 saw it."""
    out = []
    for i, ride in enumerate(rides):
        results = [worker[i] for worker in per_worker]
        if ride.kind not in (COMMIT, BASE_COMMIT):
            out.append(results[0])
            continue
        ok = [rank for rank, r in enumerate(results) if r["ok"]]
        swap_ms = max(r["swap_ms"] for r in results)
        if len(ok) == len(results):
            out.append({**results[0], "swap_ms": swap_ms})
            continue
        errors = list(dict.fromkeys(e for r in results for e in r.get("errors", ())))
        if ok:
            errors.append(f"the workers disagree: workers {ok} report the commit done")
        restored = not ok and all(r.get("restored") for r in results)
        out.append({"ok": False, "errors": errors, "restored": restored, "swap_ms": swap_ms})
    return out


def before_schedule(state: EngineCoreState) -> None:
    """Right before `schedule()`: the engine side of the queued rides takes effect."""
    rides = state.rides
    if not rides.pending:
        return
    rides.boarding, rides.pending = rides.pending, []
    for ride in rides.boarding:
        if ride.before_step is not None:
            ride.before_step()


def after_schedule(state: EngineCoreState, scheduler_output) -> None:
    """The batch just scheduled carries the rides to every worker."""
    rides = state.rides
    if not rides.boarding:
        return
    setattr(scheduler_output, RIDES_ATTR, [r.wire() for r in rides.boarding])
    rides.riding[id(scheduler_output)] = rides.boarding
    rides.stepped += len(rides.boarding)
    rides.boarding = []


def on_output(state: EngineCoreState, scheduler_output, model_runner_output) -> None:
    """The output of a batch that carried rides: answer them."""
    rides = state.rides.riding.pop(id(scheduler_output), None)
    if rides is None:
        return
    results = ride_results_of(model_runner_output)
    if results is None or len(results) != len(rides):
        results = [_unknown(r, "the step's output carried no ride results") for r in rides]
    _settle(rides, results)


def _unknown(ride: Ride, why: str) -> dict | None:
    """The result of a ride whose outcome on the workers is not known."""
    if ride.kind not in (COMMIT, BASE_COMMIT):
        return None
    return {"ok": False, "errors": [why], "restored": False, "swap_ms": 0.0}


def _settle(rides: list[Ride], results: list) -> None:
    for ride, result in zip(rides, results, strict=True):
        try:
            value = ride.settle(result) if ride.settle is not None else result
        except Exception as exc:  # answered as the utility call's failure
            ride.future.set_exception(exc)
            continue
        ride.future.set_result(value)


def flush_if_idle(process_input_queue):
    """Wrapper for `EngineCoreProc._process_input_queue`: rides queued while the engine had
    requests go out as an RPC if no step will carry them (the requests finished or were
    aborted in the same round of input, or the engine was paused)."""

    def _process_input_queue(self):
        process_input_queue(self)
        state = engine_state(self)
        if state.rides.pending and not compat.engine_will_step(self):
            try:
                flush(self, state)
            except Exception:  # answered to the rides' callers; the loop goes on
                logger.exception("art: sending queued slot-update rides to the workers failed")

    return _process_input_queue
