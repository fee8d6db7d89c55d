"""Updates their API server never ended: the workers' copies are freed, not kept for ever.

Why: an update is staged (every worker holds the new adapter's host and device copies), then
committed or aborted, then finished (`art_finish_update`), each step sent by the API server
that runs the update. An API server that dies, or loses its engine connection, between two of
those steps leaves the workers holding copies nobody will use: a staged adapter, or the undo
copy of a commit that can no longer be reverted. vLLM gives no signal for that, so age is the
signal: an update staged longer than `ABANDONED_AFTER_S` ago and never committed is aborted
here, and a commit older than that which was never finished is made final. Both go to the
workers as rides (`step_rides`: ABORT drops the staged copies, FINAL drops the undo copy), so
they cost no RPC while the engine steps.

`ABANDONED_AFTER_S` is the registry's reservation lifetime (`slot_registry.RESERVATION_TTL_S`):
engine 0 admits another update of the slot after that long, so by then no API server can still
be driving the old one. The engine looks at most every `SWEEP_EVERY_S`, after a round of input
(`sweep_after_input`): every step while it is busy, on its next input when idle (a
request, or any API call), since an idle EngineCore blocks on its input queue.
"""

from __future__ import annotations

import logging
import time

from art_vllm_plugin.engine_core import step_rides
from art_vllm_plugin.engine_core.slot_registry import RESERVATION_TTL_S
from art_vllm_plugin.engine_core.state import engine_state

logger = logging.getLogger(__name__)

ABANDONED_AFTER_S = RESERVATION_TTL_S
SWEEP_EVERY_S = 10.0


def abort(core, token: str) -> None:
    """Drop what is staged for `token` on this engine and, riding the next step, on its
    workers (a stage ride not sent yet is dropped instead)."""
    state = engine_state(core)
    state.updates.staged.pop(token, None)
    state.drop_relayed(token)  # the files on this host of a relayed stage (`relayed_stages`)
    sent = step_rides.drop(core, token)
    if sent:
        step_rides.queue(core, step_rides.Ride(step_rides.ABORT, token, ()))


def finalize(core, token: str) -> bool:
    """The update `token` can no longer be reverted on this engine: forget what its commit
    replaced, and have the workers drop their undo copy. False if nothing was committed."""
    if engine_state(core).updates.committed.pop(token, None) is None:
        return False
    step_rides.queue(core, step_rides.Ride(step_rides.FINAL, token, ()))
    return True


def sweep(core, now: float | None = None) -> list[str]:
    """Abort updates staged and finalize commits older than `ABANDONED_AFTER_S` (at most every
    `SWEEP_EVERY_S`). Returns the tokens it ended."""
    state = engine_state(core)
    now = time.monotonic() if now is None else now
    if now - state.rides.swept_at < SWEEP_EVERY_S:
        return []
    state.rides.swept_at = now
    updates = state.updates
    staged = [t for t, s in updates.staged.items() if now - s.at > ABANDONED_AFTER_S]
    committed = [t for t, c in updates.committed.items() if now - c.at > ABANDONED_AFTER_S]
    for token in staged:
        logger.warning(
            "art: update %s of slot %s (version %d) was staged %.0f s ago and never committed "
            "or aborted (its API server is gone?): freeing its staged copies",
            token,
            updates.staged[token].name,
            updates.staged[token].version,
            now - updates.staged[token].at,
        )
        abort(core, token)
    for token in committed:
        finalize(core, token)
    return staged + committed


def sweep_after_input(process_input_queue):
    """Wrapper for `EngineCoreProc._process_input_queue`: look for abandoned updates after each
    round of input (rate-limited by `sweep`)."""

    def _process_input_queue(self):
        process_input_queue(self)
        try:
            sweep(self)
        except Exception:  # never take the busy loop down; the next round tries again
            logger.exception("art: looking for abandoned slot updates failed")

    return _process_input_queue
