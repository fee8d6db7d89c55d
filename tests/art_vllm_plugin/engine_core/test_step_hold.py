"""The test-only step hold: an engine freezes its running requests itself after step N.

A stand-in engine records what `compat.freeze_running_requests` asks of it (vLLM's own
`pause_scheduler(mode="keep", clear_cache=False)`); the real servers of test_inflight_update,
test_tensor_parallel, test_leases and test_route_spans_update use the hook end to end.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from art_vllm_plugin import compat
from art_vllm_plugin.engine_core import batch_stamps, slot_updates
from art_vllm_plugin.engine_core.state import EngineCoreState, engine_state


def _core() -> SimpleNamespace:
    calls = []
    core = SimpleNamespace(
        _weight_version="default",
        pauses=calls,
        pause_scheduler=lambda mode, clear_cache: calls.append((mode, clear_cache)),
    )
    compat.attach_state(core, EngineCoreState())
    return core


def _step(core) -> None:
    batch_stamps.on_outputs(core, engine_state(core), {})


def test_the_engine_freezes_itself_after_exactly_the_armed_step(monkeypatch):
    monkeypatch.setenv(slot_updates.TEST_HOOKS_ENV, "1")
    core = _core()
    _step(core)
    assert slot_updates.art_test_hold_at_step(core, 4) is True
    for _ in range(2):
        _step(core)
    assert core.pauses == []  # 3 steps completed
    _step(core)
    assert core.pauses == [("keep", False)]  # after step 4, as /pause?mode=keep does
    _step(core)
    assert core.pauses == [("keep", False)]  # once: the hold is spent
    assert engine_state(core).hold_at_step is None


def test_a_step_that_has_passed_is_refused(monkeypatch):
    monkeypatch.setenv(slot_updates.TEST_HOOKS_ENV, "1")
    core = _core()
    for _ in range(3):
        _step(core)
    with pytest.raises(ValueError, match="step 3 has passed: 3 steps completed"):
        slot_updates.art_test_hold_at_step(core, 3)
    assert engine_state(core).hold_at_step is None


def test_the_hold_is_refused_without_the_test_hooks(monkeypatch):
    monkeypatch.delenv(slot_updates.TEST_HOOKS_ENV, raising=False)
    core = _core()
    with pytest.raises(PermissionError, match="ART_TEST_HOOKS=1"):
        slot_updates.art_test_hold_at_step(core, 10)
    assert engine_state(core).hold_at_step is None
