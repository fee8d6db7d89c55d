"""Updates their API server never ended free the workers' copies (`abandoned_updates`).

A stand-in engine (`support.stand_in_engine`); the workers' side of ABORT and FINAL rides is
test_forward_labels.py. Time is passed in (`sweep(core, now=...)`): the lifetime is 15 min.
"""

from __future__ import annotations

import time

import pytest
from support.stand_in_engine import stand_in_engine

from art_vllm_plugin.engine_core import abandoned_updates, slot_updates, step_rides
from art_vllm_plugin.engine_core.abandoned_updates import ABANDONED_AFTER_S, SWEEP_EVERY_S
from art_vllm_plugin.engine_core.state import CommittedInEngine, StagedInEngine, engine_state

pytestmark = pytest.mark.serve


def staged(at: float) -> StagedInEngine:
    return StagedInEngine(1, "policy", 3, [0], 0.0, at=at)


def test_a_stage_never_committed_is_aborted_on_the_workers_after_the_lifetime():
    core, sent = stand_in_engine(has_requests=False)
    updates = engine_state(core).updates
    now = time.monotonic()
    updates.staged["fresh"] = staged(now - 1.0)
    updates.staged["dead"] = staged(now - ABANDONED_AFTER_S - 1.0)
    assert abandoned_updates.sweep(core, now=now) == ["dead"]
    assert set(updates.staged) == {"fresh"}  # its API server may still commit it
    assert sent == [("art_run_rides", ([("abort", "dead", ())],))]


def test_a_commit_never_finished_is_made_final_after_the_lifetime():
    core, sent = stand_in_engine(has_requests=False)
    updates = engine_state(core).updates
    now = time.monotonic()
    updates.committed["dead"] = CommittedInEngine(1, 2, None, at=now - ABANDONED_AFTER_S - 1)
    updates.committed["open"] = CommittedInEngine(2, 2, None, at=now)
    assert abandoned_updates.sweep(core, now=now) == ["dead"]
    assert set(updates.committed) == {"open"}  # may still be reverted
    assert sent == [("art_run_rides", ([("final", "dead", ())],))]


def test_the_engine_looks_at_most_every_sweep_interval():
    core, _ = stand_in_engine(has_requests=False)
    updates = engine_state(core).updates
    now = time.monotonic()
    assert abandoned_updates.sweep(core, now=now) == []
    updates.staged["dead"] = staged(now - ABANDONED_AFTER_S - 1.0)
    assert abandoned_updates.sweep(core, now=now + 1.0) == []  # too soon after the last look
    assert abandoned_updates.sweep(core, now=now + SWEEP_EVERY_S + 1.0) == ["dead"]


def test_abort_rides_the_next_batch_of_a_stepping_engine():
    core, sent = stand_in_engine(has_requests=True)
    state = engine_state(core)
    state.updates.staged["t"] = staged(time.monotonic())  # its stage rode an earlier batch
    slot_updates.art_abort_lora_update(core, "t")
    assert sent == [] and "t" not in state.updates.staged
    assert [r.wire() for r in state.rides.pending] == [("abort", "t", ())]


def test_abort_of_a_stage_no_batch_carried_yet_sends_nothing():
    core, sent = stand_in_engine(has_requests=True)
    state = engine_state(core)
    step_rides.queue(core, step_rides.Ride(step_rides.STAGE, "t", (1, "policy", "/s", "/m")))
    state.updates.staged["t"] = staged(time.monotonic())
    slot_updates.art_abort_lora_update(core, "t")
    assert state.rides.pending == [] and sent == []  # the workers never saw it


def test_finishing_an_update_drops_the_workers_undo_copy():
    core, sent = stand_in_engine(has_requests=False)
    engine_state(core).updates.committed["t"] = CommittedInEngine(1, 2, None)
    slot_updates.art_finish_update(core, "t", "policy", True)
    assert sent == [("art_run_rides", ([("final", "t", ())],))]
    slot_updates.art_finish_update(core, "failed", "policy", False)  # nothing committed
    assert len(sent) == 1
