"""Exact aliases around vLLM's completion and chat handlers (`create_completion`,
`create_chat_completion`); what an alias means is in `api_server/aliases.py`.

Two wrappers, applied by `art_vllm_plugin.install` in this order (the second outermost):

1. `serve_exact_alias`: resolve `slot@N` (a lease first, then the slot's current version),
   refuse it with 409 if that version is not served, run the request on the slot's name, and
   refuse the response (409) if any token came from another version. A streaming request
   leaves its alias for the stream generator (`stream_spans`), which ends the stream instead.
   A request on a blocked slot (its update left its weights unknown) is answered 503 naming
   the failed update, before it starts or when the engine ended it (`blocked_slots`).
2. `refresh_before_alias`: an alias request is checked against a registry copy that is
   current: with one API server, the copy it keeps exact itself; with several, the copy
   cached at engine 0's pushed registry generation (`ApiServerState.registry_slots`), so an
   alias request costs no engine round trip. A push can trail an update made through another
   API server by a moment, so an alias that copy does not serve is checked once more against
   a fresh read before it is refused. A copy that is behind can only miss a newer version:
   an alias it accepts that was replaced meanwhile is still refused by the check of the
   tokens' versions.

Both reach the API server's state through the serving object (`api_server_state`).
"""

from __future__ import annotations

import functools
import inspect
from http import HTTPStatus

from art_vllm_plugin.api_server import aliases, blocked_slots
from art_vllm_plugin.api_server.state import api_server_state


def _conflict(serving, message: str):
    return serving.create_error_response(
        message, err_type="Conflict", status_code=HTTPStatus.CONFLICT
    )


def serve_exact_alias(create):
    @functools.wraps(create)
    async def create_exact(self, request, raw_request=None):
        state = api_server_state(self)
        try:
            alias = state.resolve_alias(request.model) if state is not None else None
        except aliases.AliasRefused as exc:
            return _conflict(self, exc.message)
        slot = alias.slot if alias is not None else getattr(request, "model", None)
        if state is not None and (why := await blocked_slots.reason(state, slot)) is not None:
            return blocked_slots.unavailable(self, why)
        key = request.request_id
        if alias is not None:
            request.model = alias.slot
            state.pending_aliases[key] = alias
        response = None
        try:
            response = await create(self, request, raw_request)
        except Exception:
            why = await blocked_slots.reason(state, slot, after_error=True) if state else None
            if why is not None:
                return blocked_slots.unavailable(self, why)
            raise
        finally:
            if state is not None and not inspect.isasyncgen(response):
                # No stream generator will claim the alias (not streaming, refused, failed).
                state.pending_aliases.pop(key, None)
        if state is not None and slot in state.slots.local:
            if inspect.isasyncgen(response):
                return blocked_slots.guard_stream(response, state, slot)
            if blocked_slots.is_server_error(response):
                why = await blocked_slots.reason(state, slot, after_error=True)
                if why is not None:
                    return blocked_slots.unavailable(self, why)
        if alias is not None and hasattr(response, "choices"):
            try:
                aliases.check_choices(alias, response.choices)
            except aliases.AliasRefused as exc:
                return _conflict(self, exc.message)
        return response

    return create_exact


def refresh_before_alias(create):
    @functools.wraps(create)
    async def create_refreshed(self, request, raw_request=None):
        state = api_server_state(self)
        model = getattr(request, "model", None)
        if state is not None and aliases.is_alias(model):
            await _registry_for_alias(state, model)
        return await create(self, request, raw_request)

    return create_refreshed


async def _registry_for_alias(state, model: str) -> None:
    if state.slots.sole_api_server:
        await state.slots.refresh()  # a no-op once read: every update passes through here
        return
    await state.follow_engines()
    await state.registry_slots()
    try:
        state.resolve_alias(model)
    except aliases.AliasRefused:
        await state.slots.refresh()  # the cached copy may trail another API server's update
