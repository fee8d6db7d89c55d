"""Worker side of slot updates that ride the engine's step loop (`engine_core/step_rides.py`).

EngineCore attaches an update's stage and commit to the next `SchedulerOutput` instead of
sending them as RPCs (an RPC drains the batches in flight first: a pipeline bubble). Every
worker of the engine receives that output and runs its rides at the start of the step,
before the forward and under the weights lock (`forward_labels`), so the forward computes
on the new weights and reports the new label. When the engine will not step (idle, paused)
EngineCore sends the same rides as one RPC (`art_run_rides`) instead.

A commit is all or nothing across the engine's workers *before* any forward uses it: each
worker (every tensor-parallel rank of every pipeline stage) swaps, then they all agree (an
all-reduce of a failure count along each axis of the engine, `engine_agreement`; the messages
are gathered only when one failed); where any failed, the workers that swapped put their
previous weights back at once. So no step ever computes on weights mixed across workers or
stages, and the result every worker returns is the engine's result (the executor hands
EngineCore the output of one rank only: the last stage's first rank for a step).

An abort ride drops a staged update; a final ride drops the undo copy of a commit that can no
longer be reverted (the update finished on every engine). A stage ride only starts the
staging thread (`lora_slot_writer.art_stage_lora_update`); its
outcome is the markers it leaves, as for a staging RPC.
"""

from __future__ import annotations

import functools
import time

from art_vllm_plugin import compat, staging
from art_vllm_plugin.compat.step_rides import worker_engine_cpu_groups
from art_vllm_plugin.worker import (
    adapter_receive,
    base_weights,
    engine_agreement,
    lora_slot_writer,
)
from art_vllm_plugin.worker.state import worker_state

#: Ride kinds, as EngineCore sends them: (kind, token, args).
STAGE = "stage"
COMMIT = "commit"
#: Drop what is staged for an update (aborted, or abandoned by a dead API server).
ABORT = "abort"
#: An update is final everywhere: drop the undo copy its commit kept here.
FINAL = "final"
#: A full-weight update's stage and commit (`base_weights`); ABORT and FINAL serve both kinds.
BASE_STAGE = "base_stage"
BASE_COMMIT = "base_commit"
#: A LoRA adapter the trainer streams: received, and written where the API server said
#: (`adapter_receive`); the update then stages from those files as a push does.
RECEIVE = "receive"


def run(worker, rides: list[tuple]) -> list[dict | None]:
    """Run the step's rides in order; the caller holds the weights lock. One result per ride:
    the engine-wide outcome of a commit, None for a stage."""
    results: list[dict | None] = []
    for kind, token, args in rides:
        if kind == STAGE:
            lora_int_id, lora_name, stage_dir, marker_dir = args
            start = functools.partial(
                lora_slot_writer.art_stage_lora_update,
                *(worker, token, lora_int_id, lora_name, stage_dir, marker_dir),
            )
            _start_staging(worker, marker_dir or stage_dir, start)
            results.append(None)
        elif kind == COMMIT:
            commit = functools.partial(lora_slot_writer.commit_locked, label=args[0])
            results.append(
                _commit_everywhere(worker, token, commit, lora_slot_writer.rollback_locked)
            )
        elif kind == BASE_STAGE:
            source, marker_dir, digest = args
            start = functools.partial(base_weights.stage, worker, token, source, marker_dir, digest)
            _start_staging(worker, marker_dir, start)
            results.append(None)
        elif kind == BASE_COMMIT:
            commit = functools.partial(
                base_weights.commit_locked, label=args[0], previous_dir=args[1]
            )
            results.append(_commit_everywhere(worker, token, commit, base_weights.rollback_locked))
        elif kind == RECEIVE:
            plan, marker_dir, write_dir = args
            start = functools.partial(
                adapter_receive.receive, worker, token, plan, marker_dir, write_dir
            )
            _start_staging(worker, marker_dir, start)
            results.append(None)
        elif kind == ABORT:
            lora_slot_writer.art_abort_lora_update(worker, token)
            worker_state(worker).staged_base.pop(token, None)
            results.append(None)
        elif kind == FINAL:
            worker_state(worker).undo.pop(token, None)
            worker_state(worker).undo_base.pop(token, None)
            results.append(None)
        else:
            raise ValueError(f"unknown ride kind {kind!r}")
    return results


def _start_staging(worker, marker_dir: str, start) -> None:
    """`start()` the staging thread's work. Never raises: a ride that raised would take the
    step, and so the engine, down. The failure goes where the API server looks for the
    outcome, the worker's marker in `marker_dir`."""
    try:
        start()
    except Exception as exc:
        rank = compat.worker_rank(worker)
        staging.mark(marker_dir, rank, False, f"engine\n{type(exc).__name__}: {exc}")


def art_run_rides(self, rides: list[tuple]) -> list[dict | None]:
    """RPC form, for an engine that will not step: the same rides under the weights lock."""
    with worker_state(self).weights_lock:
        return run(self, rides)


def _commit_everywhere(worker, token: str, commit, rollback) -> dict:
    """`commit(worker, token)` on this rank, then every worker of the engine agrees; where
    any failed, the workers that committed `rollback(worker, token)` at once."""
    t0 = time.perf_counter()
    try:
        mine = commit(worker, token)
    except Exception as exc:  # raised before any write (the writes restore themselves)
        # Every rank must reach the agreement below, or the others wait for it forever.
        mine = {
            "ok": False,
            "rank": compat.worker_rank(worker),
            "error": f"{type(exc).__name__}: {exc}",
            "restored": True,
        }
    groups = worker_engine_cpu_groups()
    outcomes = [mine]
    if groups and engine_agreement.count(groups, 0 if mine["ok"] else 1):
        outcomes = engine_agreement.gather(groups, mine)
    failed = [o for o in outcomes if not o["ok"]]
    restored = True
    if failed:
        restored = all(o.get("restored") for o in failed)
        if mine["ok"]:  # another rank failed: put this rank's previous weights back now
            back = rollback(worker, token)
            restored = restored and back["ok"]
            mine = {**mine, "ok": False, "restored": back["ok"], "error": back.get("error")}
        if groups:  # every worker must learn whether every worker restored
            restored = not engine_agreement.count(groups, 0 if restored else 1)
    return {
        "ok": not failed,
        "errors": [f"rank {o['rank']}: {o['error']}" for o in failed],
        "restored": restored,
        "swap_ms": (time.perf_counter() - t0) * 1000.0,
    }
