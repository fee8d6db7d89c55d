"""A slot whose update left its weights unknown serves nothing until a clean update.

Why: when a commit fails and a worker cannot restore its previous weights (the update is
answered 503, "state unknown"), the slot's workers may hold different weights (some ranks the
new ones, some the old) while its label still names the old version. Requests that kept
decoding there would get tokens labelled with a version whose weights no worker holds as a
whole. So the slot is blocked on every engine: its running and waiting requests end at once
with an error, new ones are refused, both answered 503 naming the failed update by the API
server (`api_server/blocked_slots.py`). A later update of the slot that commits on every
engine unblocks it (`SlotRegistry.finish(ok=True)`). Requests on other slots are untouched.

Who blocks: the engine whose commit could not restore, at once inside its commit call (so not
one more step runs on those weights), then the API server on every engine once the update
has failed with 503 (`art_block_slot`): with data parallelism an engine that restored cleanly
blocks too, since the slot's label no longer names one set of weights across engines.

The base weights block the same way under the registry's key `BASE`, and then every request
of the engine is ended and refused, since every request runs on the base weights.
"""

from __future__ import annotations

import functools

from art_vllm_plugin import compat
from art_vllm_plugin.compat import request_errors
from art_vllm_plugin.engine_core.slot_registry import BASE
from art_vllm_plugin.engine_core.state import engine_state


def reason(slot: str, version: int, operation_id: str | None, error: str) -> str:
    """What a refused request is told: which update failed, why, and what unblocks it."""
    op = f" (operation_id {operation_id!r})" if operation_id else ""
    return (
        f"slot {slot!r} is blocked: its update to version {version}{op} failed and left its "
        f"weights unknown ({error}); a later update of {slot!r} that commits on every engine "
        "unblocks it"
    )


def block(core, slot: str, why: str) -> int:
    """Block `slot` on this engine and end its unfinished requests with an error; returns how
    many requests were ended."""
    registry = engine_state(core).registry
    registry.block(slot, why)
    scheduler = compat.engine_scheduler(core)
    if slot == BASE:
        ids = request_errors.unfinished_request_ids(scheduler)
    elif (rec := registry.slots.get(slot)) is not None:
        ids = request_errors.unfinished_request_ids_with_lora(scheduler, {rec.lora_int_id})
    else:
        return 0
    return request_errors.fail_requests(core, ids) if ids else 0


def refuse_requests_of_blocked_slots(add_request):
    """Wrapper for `EngineCore.add_request`: a request on a blocked slot is answered with an
    error instead of being scheduled. Checked here, not only in the API server, because with
    several API servers each one's copy of the registry may be older than the block."""

    @functools.wraps(add_request)
    def add(self, request, *args, **kwargs):
        registry = engine_state(self).registry
        if registry.blocked:
            lora = request.lora_request
            if BASE in registry.blocked or (
                lora is not None and lora.lora_int_id in registry.blocked_lora_ids()
            ):
                request_errors.refuse_new_request(self, request)
                return None
        return add_request(self, request, *args, **kwargs)

    return add
