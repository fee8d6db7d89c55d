"""A full-weight stage that keeps progressing is never taken for an abandoned update.

The engines limit an update's life (`slot_registry.RESERVATION_TTL_S`, 15 min): after it,
engine 0 admits another update of the slot and `abandoned_updates` frees what was staged. A
stream of a large model may take longer and still be moving bytes; while it does, the API
server renews the update (`art_renew_update`, every `slot_publish.RENEW_EVERY_S`), which
counts the limit from then. A stand-in engine (`support.stand_in_engine`); time passed in.
"""

from __future__ import annotations

import time

import pytest
from support.stand_in_engine import stand_in_engine

from art_vllm_plugin.engine_core import abandoned_updates, base_updates
from art_vllm_plugin.engine_core.slot_registry import BASE, BASE_ID, RESERVATION_TTL_S
from art_vllm_plugin.engine_core.state import StagedInEngine, engine_state

pytestmark = pytest.mark.serve


def test_a_renewed_reservation_is_not_taken_over_after_the_lifetime():
    core, _ = stand_in_engine(has_requests=False)
    registry = engine_state(core).registry
    assert registry.reserve("stream", BASE, 1, None, None, None, now=1000.0)["ok"]
    renewed = 1000.0 + RESERVATION_TTL_S - 10
    assert registry.renew("stream", now=renewed)
    later = 1000.0 + RESERVATION_TTL_S + 1
    busy = registry.reserve("next", BASE, 1, None, None, None, now=later)
    # an update waiting behind it (`UpdateCoordinator.reserve`) sees it renewed 11 s ago
    assert busy["kind"] == "busy" and busy["held_s"] == pytest.approx(11.0)
    assert registry.reserve("next", BASE, 1, None, None, None, now=renewed + RESERVATION_TTL_S + 1)[
        "ok"
    ]  # once it stops renewing, the lifetime runs out again
    assert not registry.renew("unknown", now=later)


def test_a_renewed_stage_is_not_freed_as_abandoned():
    core, sent = stand_in_engine(has_requests=False)
    updates = engine_state(core).updates
    old = time.monotonic() - abandoned_updates.ABANDONED_AFTER_S - 1.0
    updates.staged["stream"] = StagedInEngine(BASE_ID, BASE, 1, [0, 1], 0.0, at=old)
    assert base_updates.art_renew_update(core, "stream") == {"reservation": False, "staged": True}
    assert abandoned_updates.sweep(core, now=time.monotonic()) == []
    assert "stream" in updates.staged and sent == []
