"""Engine 0 holds the one commit window of its DP group (`api_server/expert_cut.py`).

Why: vLLM starts one API server per DP engine by default, each with its own coordinators, and
each pauses every engine for its update's commit where an MoE model's experts span the
engines. Two windows at once would break both: the second would find the engines paused,
take it for a client's pause and not resume, and the first would resume them while the second
still commits. And a client's pause or resume sent to any API server must wait while some
window is open. So every window, and every client pause and resume, first takes this lease on
engine 0 (the engine every API server reaches, as for update reservations: `slot_registry`),
and gives it back at its end. A lease of an API server that died is given to the next asker
after `WINDOW_TTL_S` (a window lasts a pause and a commit: well under a second measured).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from art_vllm_plugin.engine_core.state import engine_state

#: A lease older than this is taken as its API server's death.
WINDOW_TTL_S = 300.0


@dataclass
class WindowLease:
    token: str
    purpose: str
    since: float


def art_take_commit_window(self, token: str, purpose: str) -> dict:
    """Engine 0: the window for `token` (again, if it holds it), or who holds it since when."""
    state = engine_state(self)
    now = time.monotonic()
    held = state.commit_window
    if held is not None and held.token != token and now - held.since <= WINDOW_TTL_S:
        return {"ok": False, "purpose": held.purpose, "held_s": now - held.since}
    state.commit_window = WindowLease(token, purpose, now)
    return {"ok": True}


def art_give_commit_window(self, token: str) -> bool:
    """Engine 0: end `token`'s lease (False when it held none)."""
    state = engine_state(self)
    if state.commit_window is None or state.commit_window.token != token:
        return False
    state.commit_window = None
    return True
