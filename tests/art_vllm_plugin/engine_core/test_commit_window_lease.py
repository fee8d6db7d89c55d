"""Engine 0's commit-window lease (`engine_core/commit_windows.py`): one window of a DP group at
a time, whichever API server opens it, and a client's pause or resume waits for it; the holder
asks again freely; a lease of an API server that died passes on after `WINDOW_TTL_S`.

The window itself (pause every engine, commit, resume) runs against a real DP=2 MoE server in
`tests/art_vllm_plugin/test_experts_across_engines.py`.
"""

from __future__ import annotations

import pytest
from support.stand_in_engine import stand_in_engine

from art_vllm_plugin.engine_core import commit_windows
from art_vllm_plugin.engine_core.commit_windows import (
    WINDOW_TTL_S,
    art_give_commit_window,
    art_take_commit_window,
)
from art_vllm_plugin.engine_core.state import engine_state

pytestmark = pytest.mark.serve


def test_one_window_at_a_time_and_its_holder_may_ask_again():
    core, _ = stand_in_engine(has_requests=True)
    assert art_take_commit_window(core, "a", "an update's commit window") == {"ok": True}
    assert art_take_commit_window(core, "a", "an update's commit window") == {"ok": True}
    refused = art_take_commit_window(core, "b", "a client's pause_generation")
    assert refused["ok"] is False and refused["purpose"] == "an update's commit window"
    assert not art_give_commit_window(core, "b")  # not b's to give
    assert art_take_commit_window(core, "b", "x")["ok"] is False
    assert art_give_commit_window(core, "a")
    assert art_take_commit_window(core, "b", "a client's pause_generation") == {"ok": True}


def test_a_lease_of_a_dead_api_server_passes_on_after_its_ttl(monkeypatch):
    core, _ = stand_in_engine(has_requests=True)
    now = [1000.0]
    monkeypatch.setattr(commit_windows.time, "monotonic", lambda: now[0])
    assert art_take_commit_window(core, "dead", "an update's commit window")["ok"]
    now[0] += WINDOW_TTL_S
    assert art_take_commit_window(core, "next", "w")["ok"] is False
    now[0] += 1
    assert art_take_commit_window(core, "next", "w") == {"ok": True}
    assert engine_state(core).commit_window.token == "next"
