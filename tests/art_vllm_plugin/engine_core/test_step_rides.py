"""EngineCore's side of slot updates riding the step loop (`engine_core/step_rides.py`).

A stand-in engine (scheduler, executor, config) where only the ride bookkeeping is the point;
the real EngineCore with a batch queue of 2 is test_async_provenance.py, real servers are
test_inflight_update.py (V1 and MRV2) and test_staging.py (two tensor-parallel ranks, a
failing rank).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from support.stand_in_engine import stand_in_engine

from art_vllm_plugin.engine_core import batch_stamps, step_rides
from art_vllm_plugin.engine_core.state import engine_state
from art_vllm_plugin.worker.forward_labels import RIDE_RESULTS_ATTR, RIDES_ATTR

pytestmark = pytest.mark.serve


def test_an_engine_that_will_not_step_sends_the_rides_at_once():
    core, sent = stand_in_engine(has_requests=False)
    took_effect = []
    ride = step_rides.Ride(
        step_rides.COMMIT, "t1", ("L1",), before_step=lambda: took_effect.append(1)
    )
    future = step_rides.queue(core, ride)
    assert future.done() and future.result() == {"ok": True, "swap_ms": 0.1}
    assert took_effect == [1]
    assert sent == [("art_run_rides", ([("commit", "t1", ("L1",))],))]
    assert engine_state(core).rides.flushed == 1


def test_a_stepping_engine_sends_the_rides_with_the_next_batch_and_answers_at_its_output():
    core, sent = stand_in_engine(has_requests=True)
    state = engine_state(core)
    order = []
    stage = step_rides.Ride(step_rides.STAGE, "t0", (1, "policy", "/stage", "/markers"))
    commit = step_rides.Ride(
        step_rides.COMMIT,
        "t1",
        (),
        before_step=lambda: order.append("engine side"),
        settle=lambda result: {"answered": result},
    )
    step_rides.queue(core, stage)
    future = step_rides.queue(core, commit)
    assert not future.done() and sent == []  # no RPC: the next batch carries them
    step_rides.before_schedule(state)
    assert order == ["engine side"]  # before the batch is scheduled
    batch = SimpleNamespace()
    step_rides.after_schedule(state, batch)
    assert getattr(batch, RIDES_ATTR) == [stage.wire(), commit.wire()]
    assert state.rides.stepped == 2
    other = SimpleNamespace()
    step_rides.after_schedule(state, other)  # the next batch carries nothing
    assert not hasattr(other, RIDES_ATTR)
    output = SimpleNamespace(**{RIDE_RESULTS_ATTR: [None, {"ok": True}]})
    step_rides.on_output(state, batch, output)
    assert future.result() == {"answered": {"ok": True}}
    assert sent == []


def test_a_batch_whose_output_lost_the_results_answers_its_commit_as_unknown():
    core, _ = stand_in_engine(has_requests=True)
    state = engine_state(core)
    got = []
    ride = step_rides.Ride(step_rides.COMMIT, "t1", (), settle=lambda r: got.append(r) or r)
    step_rides.queue(core, ride)
    step_rides.before_schedule(state)
    batch = SimpleNamespace()
    step_rides.after_schedule(state, batch)
    step_rides.on_output(state, batch, SimpleNamespace())
    assert got[0]["ok"] is False and got[0]["restored"] is False


def test_rides_queued_for_a_step_that_never_comes_go_out_from_the_busy_loop():
    """The requests went away (aborted, finished, paused) between the utility call and the
    next step: the busy loop sends the queued rides instead of waiting forever."""
    core, sent = stand_in_engine(has_requests=True)
    future = step_rides.queue(core, step_rides.Ride(step_rides.COMMIT, "t1", ()))
    assert not future.done()
    core.scheduler.has_requests = lambda: False
    step_rides.flush_if_idle(lambda self: None)(core)
    assert future.done() and [m for m, _ in sent] == ["art_run_rides"]


def test_an_aborted_update_drops_its_queued_rides():
    core, _ = stand_in_engine(has_requests=True)
    step_rides.queue(core, step_rides.Ride(step_rides.STAGE, "t1", ()))
    step_rides.drop(core, "t1")
    assert engine_state(core).rides.pending == []


def test_a_failed_commit_restamps_the_batches_stamped_with_its_label():
    state = engine_state(SimpleNamespace())
    state.stamps.pending[1] = ("new", "new")
    state.stamps.pending[2] = ("other", "other")
    batch_stamps.restamp(state, "new", "old")
    assert state.stamps.pending[1] == ("old", "old")
    assert state.stamps.pending[2] == ("other", "other")
