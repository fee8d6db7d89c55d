"""EngineCore side of an in-flight LoRA slot update: stage, then swap between two steps.

Utility methods added to vLLM's `EngineCore`, called from the API server with
`call_utility_async` (vLLM runs them in the busy loop between engine steps):

1. `art_stage_lora_update(token, lora_int_id, name, stage_dir, version, marker_dir, digest)`:
   has every worker start staging the adapter the API server validated and copied to
   `stage_dir`: the request rides the next scheduled batch (`step_rides`; an RPC at once when
   the engine is not stepping) and each worker hands it to a background thread, so the step
   loop is held for no worker round trip, whatever the adapter's size. The API server then
   waits for the workers' markers in `stage_dir` (`art_vllm_plugin.staging`), with no engine
   call. Refused when the version is not newer, or was committed here before with another
   digest (`version_digests`).
2. `art_commit_lora_update(token, path, digest, operation_id)`: the swap. It rides the next
   scheduled batch too and is answered (a `Future`) when that batch's output is back: the
   engine side (version, label, salts) takes effect right before the batch is scheduled;
   every worker copies its staged tensors into the slot at the start of that step (a memory
   copy, no file access), the ranks agree, and if any failed the others put back their
   previous weights before the forward (all-or-nothing), and the result says so; a failure
   some worker could not undo blocks the slot at once (`blocked_slots`). On success the
   version is bound to its digest and the registry records the path.
3. `art_abort_lora_update(token)`: drops a staged update.

The slot registry (`engine_core/slot_registry.py`: versions, committed paths, digests, recent
operation ids) lives here too, so every API server reads the same one
(`art_registry_register`, `art_registry_snapshot`). With data parallelism the API server runs
the update as a two-phase commit over every engine: `art_reserve_update` on engine 0 admits it
(operation-id replay, compare-and-swap, one update per slot at a time across API servers);
stage on every engine; commit on every engine; `art_revert_lora_update` undoes a commit on an
engine when another engine failed to commit; `art_finish_update` records the outcome on every
engine and ends the reservation; `art_block_slot` blocks a slot whose update left it unknown.

Updates of different slots run at the same time, with one constraint here: a worker keeps the
undo of every update committed and not yet finished, but forgets all of them when it starts
staging (`worker/lora_slot_writer.py`). So while another slot's update is between its commit
and its finish on this engine (it may still have to revert), staging answers `busy` and the
API server asks again; that window is a few utility calls long.

Running requests are neither aborted nor preempted. A token's version is the version of the
weights that computed it: the worker reports the label of the weights each forward used
(`worker/forward_labels.py`), and batches carry the label in force when they were scheduled
(`batch_stamps`), which a commit riding a batch keeps exact. Each update records its "engine
stall" (`stall_ms`): the step-loop time of its utility calls plus the workers' swap at the
start of the step that carried it.

Failure results are returned, not raised, so the API server can tell an adapter problem
(`kind="adapter"`, from staging) from an engine problem (`kind="commit"`).
"""

from __future__ import annotations

import os
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from art_protocol.digest import digest_dir
from art_protocol.weight_updates import slot_named
from art_vllm_plugin import compat
from art_vllm_plugin.engine_core import (
    abandoned_updates,
    batch_stamps,
    blocked_slots,
    cache_salting,
    step_rides,
)
from art_vllm_plugin.engine_core.slot_registry import BASE, BASE_ID, RESERVATION_TTL_S
from art_vllm_plugin.engine_core.state import (
    CommittedInEngine,
    SlotUpdates,
    StagedInEngine,
    engine_state,
    weight_label,
)

TEST_HOOKS_ENV = "ART_TEST_HOOKS"
#: Test-only (`art_test_inject_fault(kind="unknown")`): engines whose next failed commit
#: reports that its weights could not be restored.
_UNRESTORED_FAULT: weakref.WeakSet = weakref.WeakSet()


def version_of(state: SlotUpdates, lora_int_id: int) -> int:
    """The version this engine serves of a slot, or of the base weights (`BASE_ID`)."""
    return state.base_version if lora_int_id == BASE_ID else state.versions.get(lora_int_id, 0)


def _set_version(state: SlotUpdates, lora_int_id: int, version: int) -> None:
    if lora_int_id == BASE_ID:
        state.base_version = version
    elif version:
        state.versions[lora_int_id] = version
    else:
        state.versions.pop(lora_int_id, None)


def _resalt(core, state: SlotUpdates, lora_int_id: int) -> int:
    """Re-salt the waiting requests a change of this slot (of every slot and the base model,
    for the base weights) concerns; how many."""
    lid = None if lora_int_id == BASE_ID else lora_int_id
    return cache_salting.resalt_waiting(core, lid, state.versions, state.base_version)


def stale(state: SlotUpdates, lora_int_id: int, name: str, version: int) -> dict | None:
    current = version_of(state, lora_int_id)
    if version <= current:
        return {
            "ok": False,
            "kind": "stale",
            "error": f"stale version {version} for {slot_named(name)}: current is {current}",
            "version": current,
        }
    return None


def open_commits(core, lora_int_id: int) -> list[int]:
    """LoRA ids of other slots committed here and not yet finished (they may still revert).

    A leftover of this slot's own previous update is final: one slot's updates are serialised,
    so the next one starts only after the previous one finished (or its API server died)."""
    state = engine_state(core).updates
    now = time.monotonic()
    for token, done in list(state.committed.items()):
        if done.lora_int_id == lora_int_id or now - done.at > RESERVATION_TTL_S:
            abandoned_updates.finalize(core, token)
    return sorted({done.lora_int_id for done in state.committed.values()})


def art_stage_lora_update(
    self,
    token: str,
    lora_int_id: int,
    name: str,
    stage_dir: str,
    version: int,
    marker_dir: str | None = None,
    digest: str | None = None,
) -> dict:
    """`marker_dir`: where this engine's workers leave their markers (one directory per DP
    engine, since every engine numbers its workers from 0); default `stage_dir`. `digest`: the
    staged bytes' digest (the API server always sends it; computed from `stage_dir` if not)."""
    t0 = time.perf_counter()
    engine = engine_state(self)
    state = engine.updates
    if (refused := stale(state, lora_int_id, name, version)) is not None:
        return refused
    if not os.path.isdir(marker_dir or stage_dir):
        return unseen_stage(marker_dir or stage_dir)
    if digest is None:
        try:
            digest = digest_dir(stage_dir)
        except OSError as exc:
            return {"ok": False, "kind": "adapter", "error": f"cannot digest {stage_dir}: {exc}"}
    if (why := engine.registry.digests.refusal(name, version, digest)) is not None:
        return {"ok": False, "kind": "conflict", "error": why}
    if open_ids := open_commits(self, lora_int_id):
        return busy(open_ids)
    args = (lora_int_id, name, stage_dir, marker_dir)
    step_rides.queue(self, step_rides.Ride(step_rides.STAGE, token, args))
    ranks = list(range(compat.engine_worker_count(self)))
    engine.registry.digests.note_staged(name, token, digest)
    state.staged[token] = StagedInEngine(
        lora_int_id, name, version, ranks, time.perf_counter() - t0
    )
    return {"ok": True, "ranks": ranks, "stall_ms": (time.perf_counter() - t0) * 1e3}


def busy(open_ids: list[int]) -> dict:
    """Staging refused while other updates are between their commit and their finish here."""
    names = ["the base weights" if i == BASE_ID else f"LoRA id {i}" for i in open_ids]
    return {
        "ok": False,
        "kind": "busy",
        "error": f"updates of {', '.join(names)} are committing on this engine",
    }


def unseen_stage(path: str) -> dict:
    """The stage the API server wrote is not on this engine's file system: its workers would
    never find it, nor could they leave a marker, and the update would wait minutes for one.
    Refused at once instead, naming the way out."""
    return {
        "ok": False,
        "kind": "staging",
        "status": 500,
        "error": f"this engine cannot see the staging directory {path}: the API server and "
        "the engine do not share it (containers with a /dev/shm each?). Start the server with "
        "--art-staging-dir (or ART_STAGING_DIR) on a directory both see",
    }


@dataclass
class _Commit:
    """One commit on its way through the step loop (`step_rides`)."""

    token: str
    staged: StagedInEngine
    path: str | None
    digest: str | None
    operation_id: str | None
    inflight_batches: int
    engine_s: float = 0.0  # step-loop time of the utility call and of `_take_effect`
    label: str | None = None
    step: int = 0
    previous_version: int = 0
    resalted: int = 0


def art_commit_lora_update(
    self,
    token: str,
    path: str | None = None,
    digest: str | None = None,
    operation_id: str | None = None,
) -> Future | dict:
    """The swap, riding the next step (`step_rides`): answered once the workers swapped (a
    `Future`, which vLLM answers when done). A registered slot's record gets the committed
    `path` and `digest`, and the version stays bound to that digest on this engine. A failure
    that some worker could not undo blocks the slot here before the answer
    (`blocked_slots`)."""
    t0 = time.perf_counter()
    engine = engine_state(self)
    state = engine.updates
    staged = state.staged.pop(token, None)
    if staged is None:
        return {"ok": False, "kind": "commit", "error": "no staged update", "restored": True}
    if (refused := stale(state, staged.lora_int_id, staged.name, staged.version)) is not None:
        art_abort_lora_update(self, token)
        return refused
    commit = _Commit(
        token, staged, path, digest, operation_id, compat.engine_inflight_batches(self)
    )
    kind = step_rides.BASE_COMMIT if staged.lora_int_id == BASE_ID else step_rides.COMMIT
    ride = step_rides.Ride(kind, token, ())
    ride.before_step = lambda: _take_effect(self, commit, ride)
    ride.settle = lambda result: _settle(self, commit, result)
    commit.engine_s = time.perf_counter() - t0
    return step_rides.queue(self, ride)


def _take_effect(core, commit: _Commit, ride: step_rides.Ride) -> None:
    """Right before the batch that carries the commit is scheduled: that batch and every later
    one are stamped with the new label, and waiting requests take the new salt."""
    t0 = time.perf_counter()
    engine = engine_state(core)
    state = engine.updates
    lid = commit.staged.lora_int_id
    commit.step = engine.stamps.scheduled  # batches so far ran on the old weights
    commit.previous_version = version_of(state, lid)
    _set_version(state, lid, commit.staged.version)
    # The label of the weights after the swap: each worker holds it beside them and reports it
    # with every forward that uses them (worker/forward_labels.py).
    commit.label = weight_label(state)
    # A base commit also names where the weights it replaces can be read again (its undo).
    ride.args = (commit.label, state.base_path) if lid == BASE_ID else (commit.label,)
    compat.set_engine_weight_label(core, commit.label)
    commit.resalted = _resalt(core, state, lid)
    commit.engine_s += time.perf_counter() - t0


def _settle(core, commit: _Commit, result: dict) -> dict:
    """The workers' engine-wide outcome of the swap: record it, or undo the engine side."""
    engine = engine_state(core)
    state = engine.updates
    staged = commit.staged
    if not result["ok"]:
        return _failed(core, commit, result)
    digest = commit.digest or engine.registry.digests.staged_digest(staged.name, commit.token)
    if digest is not None:
        engine.registry.digests.bind(staged.name, staged.version, digest)
    previous_record = None
    if staged.name in engine.registry.slots and commit.path is not None:
        previous_record = engine.registry.commit(
            staged.name, staged.version, commit.path, digest or ""
        )
    if staged.lora_int_id == BASE_ID:  # the record of the base weights: path, digest, count
        previous_record = engine.registry.commit(
            BASE, staged.version, commit.path or "", digest or ""
        )
        state.base_path = commit.path
    state.committed[commit.token] = CommittedInEngine(
        staged.lora_int_id, commit.previous_version, previous_record
    )
    state.updates += 1
    commit_ms = commit.engine_s * 1000.0 + result["swap_ms"]
    stall_ms = staged.stall_s * 1000.0 + commit_ms
    state.stalls_ms.append(stall_ms)
    state.commit_stalls_ms.append(commit_ms)
    return {
        "ok": True,
        # Batches scheduled before it ran on the old weights; the next one on the new.
        "step": commit.step,
        "engine_ms": commit_ms,
        "stall_ms": stall_ms,
        "swap_ms": result["swap_ms"],
        "inflight_batches": commit.inflight_batches,
        "workers": list(range(compat.engine_worker_count(core))),
        "versions": dict(state.versions),
        "base_version": state.base_version,
        "resalted_waiting": commit.resalted,
    }


def _failed(core, commit: _Commit, result: dict) -> dict:
    """Every worker put its previous weights back before any forward used the new ones (or
    one could not: the slot is blocked); the engine side goes back too."""
    engine = engine_state(core)
    state = engine.updates
    staged = commit.staged
    lid = staged.lora_int_id
    state.failed_commits += 1
    _set_version(state, lid, commit.previous_version)
    label = weight_label(state)
    compat.set_engine_weight_label(core, label)
    batch_stamps.restamp(engine, commit.label, label)
    _resalt(core, state, lid)
    restored = bool(result.get("restored"))
    errors = "; ".join(result.get("errors") or ["the commit failed"])
    if core in _UNRESTORED_FAULT:
        _UNRESTORED_FAULT.discard(core)
        restored = False
        errors += "; the restore is reported failed (test hook 'unknown')"
    if not restored:
        why = blocked_slots.reason(staged.name, staged.version, commit.operation_id, errors)
        blocked_slots.block(core, staged.name, why)
    return {"ok": False, "kind": "commit", "error": errors, "restored": restored}


def art_revert_lora_update(self, token: str) -> dict:
    """Undo this engine's commit of `token` because another engine failed to commit it:
    every worker puts back its previous weights and the registry its previous record."""
    engine = engine_state(self)
    state = engine.updates
    done = state.committed.pop(token, None)
    if done is None:
        return {"ok": True, "restored": False}  # nothing was committed here
    method = (
        "art_rollback_base_update" if done.lora_int_id == BASE_ID else "art_rollback_lora_update"
    )
    rolled = compat.engine_executor(self).collective_rpc(method, args=(token,))
    # Every worker committed this update here, so each must have had its undo to put back; one
    # that had none (`restored: False`) still holds the new weights.
    lost = [r for r in rolled if r["ok"] and not r.get("restored")]
    _set_version(state, done.lora_int_id, done.previous_version)
    if done.previous_record is not None:
        engine.registry.revert(done.previous_record)
        if done.lora_int_id == BASE_ID:
            state.base_path = done.previous_record.path or None
    state.updates -= 1
    compat.set_engine_weight_label(self, weight_label(state))
    _resalt(self, state, done.lora_int_id)
    failed = [r for r in rolled if not r["ok"]]
    errors = [f"rank {r['rank']}: {r['error']}" for r in failed]
    errors += [f"rank {r['rank']}: no undo left to restore" for r in lost]
    return {"ok": not errors, "restored": not errors, "error": "; ".join(errors)}


def art_block_slot(self, slot: str, version: int, operation_id: str | None, error: str) -> dict:
    """Block `slot` here: its update to `version` failed with the slot's state unknown. Its
    requests end with an error and new ones are refused until an update commits everywhere."""
    ended = blocked_slots.block(
        self, slot, blocked_slots.reason(slot, version, operation_id, error)
    )
    return {"ok": True, "ended_requests": ended}


def art_registry_register(self, slots: list[dict]) -> dict:
    """Register an API server's start slots (idempotent); returns the registry snapshot."""
    engine_state(self).registry.register(slots)
    return art_registry_snapshot(self)


def art_registry_snapshot(self) -> dict:
    engine = engine_state(self)
    engine.registry_reads += 1
    return engine.registry.snapshot()


def art_reserve_update(
    self,
    token: str,
    slot: str,
    version: int,
    expected_version: int | None,
    operation_id: str | None,
    fingerprint: str | None,
) -> dict:
    """Engine 0: admit an update (see `SlotRegistry.reserve`)."""
    return engine_state(self).registry.reserve(
        token, slot, version, expected_version, operation_id, fingerprint
    )


def art_finish_update(
    self,
    token: str,
    slot: str,
    ok: bool,
    operation_id: str | None = None,
    fingerprint: str | None = None,
    response: dict | None = None,
    elapsed_ms: float | None = None,
) -> bool:
    """Every engine, once the update ended everywhere: the commit is final (no revert any
    more), the outcome is recorded and the reservation (engine 0) ends."""
    state = engine_state(self)
    abandoned_updates.finalize(self, token)  # the workers drop their undo copy
    state.registry.finish(
        token,
        slot,
        ok=ok,
        operation_id=operation_id,
        fingerprint=fingerprint,
        response=response,
        elapsed_ms=elapsed_ms,
    )
    return True


def art_abort_lora_update(self, token: str) -> bool:
    """Drop the staged update `token`: the workers drop their copies riding the next step (or
    at once when the engine is not stepping), like the stage itself."""
    abandoned_updates.abort(self, token)
    return True


def art_test_inject_fault(self, kind: str, rank: int) -> bool:
    """Test-only hook, refused unless the server runs with ART_TEST_HOOKS=1. Kinds "commit"
    and "stage" arm worker `rank` (`worker/lora_slot_writer.py`). Kind "unknown": worker `rank`
    fails its next commit as with "commit", and this engine then reports that the restore
    failed, as when a worker cannot put its weights back: the update's state is unknown
    (503) and the slot is blocked."""
    if os.environ.get(TEST_HOOKS_ENV) != "1":
        raise PermissionError(f"test hooks are off (set {TEST_HOOKS_ENV}=1 to enable)")
    if kind == "unknown":
        _UNRESTORED_FAULT.add(self)
        kind = "commit"
    compat.engine_executor(self).collective_rpc("art_test_inject_fault", args=(kind, rank))
    return True


def art_test_hold_at_step(self, step: int) -> bool:
    """Test-only hook, refused unless the server runs with ART_TEST_HOOKS=1: once `step` engine
    steps have completed, freeze the running requests (as `POST /pause?mode=keep` does) from
    inside the engine. A test that needs an update to land after exactly that step arms it
    before sending the request; a pause sent by a client lands wherever the host's timing
    puts it, possibly after the request ended. `POST /resume` continues."""
    if os.environ.get(TEST_HOOKS_ENV) != "1":
        raise PermissionError(f"test hooks are off (set {TEST_HOOKS_ENV}=1 to enable)")
    state = engine_state(self)
    if step <= state.stamps.completed:
        raise ValueError(f"step {step} has passed: {state.stamps.completed} steps completed")
    state.hold_at_step = step
    return True


def art_slot_state(self) -> dict[str, Any]:
    """Versions, steps, update count, stalls and waiting requests, for tests and metrics."""
    engine = engine_state(self)
    state, s = engine.updates, engine.stamps
    return {
        "versions": dict(state.versions),
        "base_version": state.base_version,
        "steps": s.completed,
        "scheduled": s.scheduled,
        "batch_queue_size": compat.engine_batch_queue_size(self),
        "paused": compat.engine_paused(self),
        "updates": state.updates,
        "failed_commits": state.failed_commits,
        "blocked": dict(engine.registry.blocked),
        "label": compat.engine_weight_label(self),
        "waiting": sum(1 for _ in compat.waiting_requests(compat.engine_scheduler(self))),
        "stalls_ms": list(state.stalls_ms),
        "commit_stalls_ms": list(state.commit_stalls_ms),
        "mean_step_ms": s.mean_step_ms(),
        # Outputs labelled by their worker at the forward, and how many of those the
        # engine's stamp disagreed with (worker/forward_labels.py; 0 on tested executors).
        "worker_labelled": s.worker_labelled,
        "label_mismatches": s.label_mismatches,
        # Stage and commit work that rode a scheduled batch, or went as an RPC to an engine
        # that was not stepping (step_rides.py).
        "rides": {"stepped": engine.rides.stepped, "flushed": engine.rides.flushed},
        # Registry reads by API servers (`art_registry_snapshot`): alias checks and
        # /art/metrics answer from their cached copy, so these stay rare under load.
        "registry_reads": engine.registry_reads,
        # Stages written on this engine's host from bytes sent in the stage call, because
        # the engine runs on another host than the API server (relayed_stages.py).
        "relayed_stages": engine.relayed_total,
    }
