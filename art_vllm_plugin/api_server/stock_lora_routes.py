"""Stock `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` refuse slot names (409).

A slot's weights change only through `/art/v1/lora/update` (staged, validated, committed on
every worker between two steps, versioned). vLLM's own routes know nothing of that: loading
(also with `load_inplace`) a slot's name reports success while the plugin's loader keeps
serving the committed weights, and unloading it would drop a slot that every engine still
serves. Both are refused, naming the route to use; other LoRA names behave as in stock vLLM.
"""

from __future__ import annotations

import functools
from http import HTTPStatus

from art_vllm_plugin import compat

UPDATE_ROUTE = "/art/v1/lora/update"


def refuse_slot_names(handler):
    """Wrapper for `OpenAIServingModels.load_lora_adapter` / `unload_lora_adapter`."""

    @functools.wraps(handler)
    async def guarded(self, request, *args, **kwargs):
        state = compat.attached_state(self)
        name = getattr(request, "lora_name", None)
        if state is not None and name in state.slots.local:
            what = "load" if handler.__name__.startswith("load") else "unload"
            return compat.error_response(
                f"{name!r} is an art slot: stock /v1/{what}_lora_adapter would not change what "
                f"it serves; publish a new version with POST {UPDATE_ROUTE} "
                '({"slot", "path", "version"})',
                err_type="Conflict",
                status_code=HTTPStatus.CONFLICT,
            )
        return await handler(self, request, *args, **kwargs)

    return guarded
