"""An engine stages a slot's update only when no other slot's update may still revert there.

A worker forgets every update's undo when it starts staging (`worker/lora_slot_writer.py`), so
EngineCore answers `busy` while another slot's commit is not yet finished everywhere (the API
server asks again). A leftover of the same slot's previous update, or one whose API server
died long ago (`RESERVATION_TTL_S`), is final and does not hold anything up: it is made final
here and on the workers (a FINAL ride drops their undo copy).
"""

from __future__ import annotations

import time

import pytest
from support.stand_in_engine import stand_in_engine

from art_vllm_plugin.engine_core import slot_updates
from art_vllm_plugin.engine_core.slot_registry import RESERVATION_TTL_S
from art_vllm_plugin.engine_core.state import CommittedInEngine, engine_state

pytestmark = pytest.mark.serve


def committed(lora_int_id: int, at: float | None = None):
    if at is None:
        return CommittedInEngine(lora_int_id, 0, None)
    return CommittedInEngine(lora_int_id, 0, None, at=at)


def test_another_slots_open_commit_holds_staging_back():
    core, sent = stand_in_engine(has_requests=False)
    state = engine_state(core).updates
    state.committed["t-other"] = committed(2)
    assert slot_updates.open_commits(core, 1) == [2]
    assert "t-other" in state.committed  # it may still revert: kept
    assert sent == []


def test_the_same_slots_leftover_is_final():
    core, sent = stand_in_engine(has_requests=False)
    state = engine_state(core).updates
    state.committed["t-old"] = committed(1)
    assert slot_updates.open_commits(core, 1) == []
    assert not state.committed
    assert sent == [("art_run_rides", ([("final", "t-old", ())],))]


def test_a_commit_left_by_a_dead_api_server_expires():
    core, sent = stand_in_engine(has_requests=False)
    state = engine_state(core).updates
    state.committed["t-dead"] = committed(2, at=time.monotonic() - RESERVATION_TTL_S - 1)
    assert slot_updates.open_commits(core, 1) == []
    assert not state.committed
    assert sent == [("art_run_rides", ([("final", "t-dead", ())],))]


def test_a_base_commit_and_a_slot_commit_hold_each_other_back():
    """A base update's revert and a slot update's each put back the label they replaced: they
    must not interleave (`engine_core/base_updates.py`)."""
    core, _ = stand_in_engine(has_requests=False)
    state = engine_state(core).updates
    state.committed["t-base"] = committed(slot_updates.BASE_ID)
    assert slot_updates.open_commits(core, 1) == [slot_updates.BASE_ID]
    assert "the base weights" in slot_updates.busy([slot_updates.BASE_ID])["error"]
    del state.committed["t-base"]
    state.committed["t-slot"] = committed(1)
    assert slot_updates.open_commits(core, slot_updates.BASE_ID) == [1]
