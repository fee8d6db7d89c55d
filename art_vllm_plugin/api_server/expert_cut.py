"""Commit an update on every data-parallel engine at one step of the group, where an MoE
model's experts span the engines (issue 36, item 5).

Why: an update's two-phase commit is exact per engine (each swaps at its own next step:
`engine_core/step_rides.py`), which is enough where each engine's tokens meet only its own
weights. With a mixture-of-experts model over several DP engines they do not
(`expert_layout.experts_across_engines`): tokens of every engine pass through experts on other
engines, in lock step. Committed at each engine's own next step, a batch between the first
engine's commit and the last one's would compute with experts of two versions under one label,
and a commit that fails on one engine after another committed would leave both on mixed
experts until the revert.

How: vLLM's own pause. `pause_scheduler(mode="keep")` on every engine stops them all at the
same step of the group (`DPEngineCoreProc._pause_complete`: each engine asks, the group agrees
in its DP all-reduce, every engine stops after the same forward) and its future completes once
no batch is in flight. The commit (and any revert) then runs on every engine while no forward
runs anywhere: its rides go to the workers as one RPC (`step_rides.flush`; a paused engine
will not step), and the engines resume together. Every forward before the window computed on
the old experts everywhere, every forward after it on the new ones; requests are kept, so the
cost is the pause itself (`stall_ms` of the update, and `GET /art/v1/weights` `commit_window`).

A client's own pause is left alone: when the engines are paused already (an RL loop that
pauses, updates and resumes), the commit runs inside that pause and nothing is resumed. One
window at a time per DP group, whichever API server opens it (vLLM starts one per DP engine by
default), and a client's `pause_generation` / `resume_generation` through any of them waits
while a window is open (`hold_client_pauses`), so nothing resumes the engines mid-commit: each
takes engine 0's window lease first (`engine_core/commit_windows.py`), and inside one API
server a lock keeps its own windows from polling engine 0 for each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
import weakref
from dataclasses import dataclass, field

from art_vllm_plugin import compat
from art_vllm_plugin.expert_layout import experts_across_engines

logger = logging.getLogger("vllm.art_plugin.expert_cut")
#: How long a window, or a client's pause or resume, waits for engine 0's lease (another API
#: server's window, or a client's pause that drains its requests), and how often it asks.
LEASE_WAIT_S = 300.0
_LEASE_POLL_S = 0.01


class CommitWindowError(RuntimeError):
    """The engines could not be paused together: nothing was committed."""


@dataclass
class CommitWindow:
    """The commit windows of one API server's engines; `why` is None where each engine may
    commit at its own step (no window)."""

    why: str | None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: Windows opened, those that found the engines paused by a client, the last one's pause
    #: (engines stopping at one step) and whole length, in ms.
    opened: int = 0
    inside_client_pause: int = 0
    last_pause_ms: float | None = None
    last_window_ms: float | None = None

    def figures(self) -> dict:
        return {
            "required": self.why is not None,
            "why": self.why,
            "opened": self.opened,
            "inside_client_pause": self.inside_client_pause,
            "last_pause_ms": self.last_pause_ms,
            "last_window_ms": self.last_window_ms,
        }


_WINDOWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def window_of(engine_client) -> CommitWindow:
    """This engine client's window rule (read once from its config)."""
    window = _WINDOWS.get(engine_client)
    if window is None:
        window = _WINDOWS[engine_client] = CommitWindow(
            experts_across_engines(engine_client.vllm_config)
        )
    return window


@contextlib.asynccontextmanager
async def commit_window(engine_client):
    """Around an update's commit (and revert) on every engine: with experts across engines,
    no engine steps inside it (see the module docstring); otherwise nothing."""
    window = window_of(engine_client)
    if window.why is None:
        yield
        return
    async with window.lock, _lease(engine_client, "an update's commit window"):
        t0 = time.perf_counter()
        try:
            paused_by_client = await compat.engines_paused(engine_client)
            if not paused_by_client:
                await compat.pause_engines_keeping_requests(engine_client)
        except Exception as exc:
            raise CommitWindowError(
                "the engines could not be paused at one step of their group before the commit "
                f"({type(exc).__name__}: {exc}); no engine committed"
            ) from exc
        window.opened += 1
        window.inside_client_pause += int(paused_by_client)
        window.last_pause_ms = (time.perf_counter() - t0) * 1e3
        try:
            yield
        finally:
            if not paused_by_client:
                try:  # shielded: a cancelled update must not leave every engine paused
                    await asyncio.shield(compat.resume_engines(engine_client))
                except Exception:  # the update's outcome stands; the server must be told
                    logger.exception("art: the engines did not resume after a commit window")
            window.last_window_ms = (time.perf_counter() - t0) * 1e3
            logger.info(
                "art commit window: engines %s in %.1f ms, window %.1f ms",
                "already paused by a client" if paused_by_client else "paused at one step",
                window.last_pause_ms,
                window.last_window_ms,
            )


def hold_client_pauses(method):
    """Wrapper for `AsyncLLM.pause_generation` / `resume_generation`: a client's pause or
    resume waits while this API server's commit window is open."""

    @functools.wraps(method)
    async def waits_for_the_commit_window(self, *args, **kwargs):
        window = window_of(self)
        if window.why is None:
            return await method(self, *args, **kwargs)
        async with window.lock, _lease(self, f"a client's {method.__name__}"):
            return await method(self, *args, **kwargs)

    return waits_for_the_commit_window


@contextlib.asynccontextmanager
async def _lease(engine_client, purpose: str):
    """Engine 0's window lease for the duration (`engine_core/commit_windows.py`)."""
    token = uuid.uuid4().hex
    _rank, engine0 = compat.engine_targets(engine_client)[0]
    deadline = time.monotonic() + LEASE_WAIT_S
    while True:
        held = await compat.call_engine_utility_on(
            engine_client, engine0, "art_take_commit_window", token, purpose
        )
        if held["ok"]:
            break
        if time.monotonic() > deadline:
            raise CommitWindowError(
                f"{purpose} waited {LEASE_WAIT_S:.0f} s for {held['purpose']} (open for "
                f"{held['held_s']:.0f} s) to end; nothing was paused or committed"
            )
        await asyncio.sleep(_LEASE_POLL_S)
    try:
        yield
    finally:
        try:  # shielded: a cancelled caller must not keep the lease until its TTL
            await asyncio.shield(
                compat.call_engine_utility_on(
                    engine_client, engine0, "art_give_commit_window", token
                )
            )
        except Exception:
            logger.exception("art: engine 0 did not take back the commit-window lease")
