"""Requests on a blocked slot are answered 503, naming the update that failed.

A slot is blocked when an update of it failed with its state unknown (some worker may hold the
new weights under the old label); EngineCore ends the slot's running and waiting requests with
an error and refuses new ones until an update commits cleanly everywhere
(`engine_core/blocked_slots.py`). vLLM would answer those as a generic 500 ("Internal server
error"); here the API server says what happened instead:

- a new request on a blocked slot is refused with 503 before it reaches the engine, when this
  is the only API server (its copy of the registry is then exact, `SlotView.refresh`); with
  several API servers the engine refuses it, as below, since this server's copy may be older
  than the block;
- a request that ended with an error (running when the slot was blocked, or refused by the
  engine) is answered 503 with the reason if its slot is blocked (the registry is read again
  first), and a stream's error event likewise; any other error stays as vLLM made it.

The base weights block like a slot (a full-weight update whose state is unknown,
`api_server/base_updates.py`), and then every request is refused, whatever model it names:
the same 503, naming the base weights' failed update.

Called from the alias wrapper around vLLM's completion and chat handlers
(`api_server/alias_requests.py`), which knows the slot a request runs on.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from art_vllm_plugin.api_server import chunk_splice
from art_vllm_plugin.compat.api_server import streaming_error_event

logger = logging.getLogger("vllm.art_plugin.slots")


async def reason(state, slot: str | None, after_error: bool = False) -> str | None:
    """Why a request on `slot` (a slot, or any other model name: the base model) is refused,
    None when it serves: its slot is blocked, or the base weights are. Before a request: only
    with a sole API server (else the engine decides); after an error: read from engine 0
    again."""
    view = state.slots
    if slot is None:
        return None
    if not after_error and not view.sole_api_server:
        return None
    try:
        await view.refresh(force=after_error)
    except Exception as exc:  # an engine that cannot answer: vLLM's own answer stands
        logger.warning("art: could not read the slot registry for %s: %s", slot, exc)
        return None
    if why := view.base.get("blocked"):
        return f"the base weights are blocked, every request is refused: {why}"
    current = view.slots.get(slot) if slot in view.local else None
    return current.blocked if current is not None else None


def unavailable(serving, message: str):
    """vLLM's error response with status 503."""
    return serving.create_error_response(
        message, err_type="ServiceUnavailable", status_code=HTTPStatus.SERVICE_UNAVAILABLE
    )


def is_server_error(response) -> bool:
    """A vLLM `ErrorResponse` with a 5xx code (returned rather than raised)."""
    code = getattr(getattr(response, "error", None), "code", None)
    return isinstance(code, int) and code >= 500


async def guard_stream(stream, state, slot: str):
    """`stream` with an error event replaced by 503 naming the failed update when the error
    came from the slot being blocked."""
    try:
        async for chunk in stream:
            if isinstance(chunk, str) and chunk_splice.is_error(chunk):
                why = await reason(state, slot, after_error=True)
                if why is not None:
                    chunk = streaming_error_event(why, "ServiceUnavailable", 503)
            yield chunk
    finally:
        await stream.aclose()
