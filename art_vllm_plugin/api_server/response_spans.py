"""Attach `policy_spans` to every choice of `/v1/completions` and `/v1/chat/completions`.

vLLM assembles the final `CompletionOutput`s (n>1 children included) with
`weight_versions` spans but drops them from the OpenAI responses. We wrap the two places where
those responses are built, keep vLLM's own assembly, and add one field per choice (the
response models accept extra fields):

    "policy_spans": [{"start", "end", "slot", "version"}]   # half-open, contiguous, complete

Streaming responses carry spans per chunk: see `stream_spans`.
"""

from __future__ import annotations

import functools
import inspect
from http import HTTPStatus

from art_protocol.provenance import policy_spans
from art_vllm_plugin import compat
from art_vllm_plugin.api_server import aliases, stream_spans

_MARK = "__art_patched__"


def spans_for_output(output, lora_request) -> list[dict]:
    slot = lora_request.lora_name if lora_request is not None else None
    lora_id = lora_request.lora_int_id if lora_request is not None else None
    return policy_spans(
        getattr(output, "weight_versions", None), len(output.token_ids), slot, lora_id
    )


def _wrap_completion_response(original):
    @functools.wraps(original)
    def request_output_to_completion_response(self, final_res_batch, *args, **kwargs):
        response = original(self, final_res_batch, *args, **kwargs)
        # vLLM appends one choice per (prompt, output) in this order.
        outputs = [(res, out) for res in final_res_batch for out in res.outputs]
        for choice, (res, out) in zip(response.choices, outputs, strict=True):
            choice.policy_spans = spans_for_output(out, res.lora_request)
        return response

    return request_output_to_completion_response


def _wrap_chat_full_generator(original):
    @functools.wraps(original)
    async def chat_completion_full_generator(self, request, result_generator, *args, **kwargs):
        last = []

        async def capture():
            async for res in result_generator:
                last[:] = [res]
                yield res

        response = await original(self, request, capture(), *args, **kwargs)
        choices = getattr(response, "choices", None)
        if last and choices is not None:
            by_index = {out.index: out for out in last[0].outputs}
            for choice in choices:
                choice.policy_spans = spans_for_output(by_index[choice.index], last[0].lora_request)
        return response

    return chat_completion_full_generator


#: The API server's slot registry, set by `install`; aliases are resolved against it.
_REGISTRY: list = []
#: Alias of a request in flight, keyed by the request's own id (`request.request_id`, a
#: fresh uuid unless the client sets one), for its stream generator. Not by `id(request)`:
#: an entry left behind by a refused request would be found by a later, unrelated request
#: object allocated at the same address.
_ALIASES: dict[str, aliases.Alias] = {}


def _key(request) -> str:
    return request.request_id


def pending_alias(request) -> aliases.Alias | None:
    return _ALIASES.pop(_key(request), None)


def _slots() -> dict:
    return _REGISTRY[0].slots if _REGISTRY else {}


def _wrap_create(original):
    @functools.wraps(original)
    async def create(self, request, raw_request=None):
        try:
            alias = aliases.resolve(request.model, _slots())
        except aliases.AliasRefused as exc:
            return self.create_error_response(
                exc.message, err_type="Conflict", status_code=HTTPStatus.CONFLICT
            )
        if alias is not None:
            request.model = alias.slot
            _ALIASES[_key(request)] = alias
        response = None
        try:
            response = await original(self, request, raw_request)
        finally:
            if not inspect.isasyncgen(response):
                # No stream generator will claim the alias (not streaming, refused, failed).
                _ALIASES.pop(_key(request), None)
        if alias is not None and hasattr(response, "choices"):
            try:
                aliases.check_choices(alias, response.choices)
            except aliases.AliasRefused as exc:
                return self.create_error_response(
                    exc.message, err_type="Conflict", status_code=HTTPStatus.CONFLICT
                )
        return response

    return create


def install(registry) -> None:
    _REGISTRY[:] = [registry]
    completion = compat.serving_completion_class()
    chat = compat.serving_chat_class()
    if getattr(completion, _MARK, False):
        return
    completion.request_output_to_completion_response = _wrap_completion_response(
        completion.request_output_to_completion_response
    )
    completion.create_completion = _wrap_create(completion.create_completion)
    chat.chat_completion_full_generator = _wrap_chat_full_generator(
        chat.chat_completion_full_generator
    )
    chat.create_chat_completion = _wrap_create(chat.create_chat_completion)
    stream_spans.install(compat.request_state_class(), completion, chat)
    setattr(completion, _MARK, True)
