"""Attach `policy_spans` to every choice of `/v1/completions` and `/v1/chat/completions`.

vLLM assembles the final `CompletionOutput`s (n>1 children included) with
`weight_versions` spans but drops them from the OpenAI responses. We wrap the two places where
those responses are built, keep vLLM's own assembly, and add one field per choice (the
response models accept extra fields):

    "policy_spans": [{"start", "end", "slot", "version"}]   # half-open, contiguous, complete

Streaming responses carry spans per chunk: see `stream_spans`. Beam-search answers, which
vLLM assembles without labels, get theirs from `beam_search_spans` before they reach here.
Exact aliases (`slot@N`) are checked around the handlers that call these: see
`alias_requests`. Labels that do not cover a choice's tokens are an error (`policy_spans`
raises; vLLM answers 500 naming it), the same one a stream ends with, never a made-up
version.
"""

from __future__ import annotations

import functools

from art_protocol.provenance import policy_spans


def spans_for_output(output, lora_request) -> list[dict]:
    slot = lora_request.lora_name if lora_request is not None else None
    lora_id = lora_request.lora_int_id if lora_request is not None else None
    return policy_spans(
        getattr(output, "weight_versions", None), len(output.token_ids), slot, lora_id
    )


def spans_on_completion_choices(original):
    @functools.wraps(original)
    def request_output_to_completion_response(self, final_res_batch, *args, **kwargs):
        response = original(self, final_res_batch, *args, **kwargs)
        # vLLM appends one choice per (prompt, output) in this order.
        outputs = [(res, out) for res in final_res_batch for out in res.outputs]
        for choice, (res, out) in zip(response.choices, outputs, strict=True):
            choice.policy_spans = spans_for_output(out, res.lora_request)
        return response

    return request_output_to_completion_response


def spans_on_chat_choices(original):
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
