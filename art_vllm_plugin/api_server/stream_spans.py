"""Policy spans on streaming responses (`stream: true`) of completions and chat.

Each SSE chunk of a choice that carries tokens (text, a chat delta, or the finish) carries
`policy_spans` for the tokens that arrived since the choice's previous spans: half-open ranges
in the choice's own token positions (0 = its first completion token), so concatenating a
choice's chunk spans (merging neighbours of equal version) gives exactly the non-streaming
`policy_spans` of the same generation. With `n > 1` every choice index has its own.

How: vLLM keeps per-request weight-version starts in the output processor but only reports
them on the final output. We attach the spans-so-far to every output
(vLLM's `RequestState`, through `compat`), wrap the stream generator's `result_generator` to turn
each delta into spans for its new tokens, and add those to the chunk the generator yields for
that choice. A stream on an exact alias (`slot@N`) whose tokens turn out to come from another
version is ended with an error event instead of silently continuing.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections import defaultdict

from art_protocol.provenance import extend_spans, slot_spans, slot_version
from art_vllm_plugin import compat
from art_vllm_plugin.api_server.state import api_server_state


def _new_token_spans(output, lora_request, produced: int) -> tuple[list[dict], int]:
    """Spans of this delta's tokens, given how many tokens the choice had before."""
    new = len(output.token_ids)
    if not new:
        return [], produced
    slot = lora_request.lora_name if lora_request is not None else None
    lora_id = lora_request.lora_int_id if lora_request is not None else None
    start, end = produced, produced + new
    spans = slot_spans(getattr(output, "weight_versions", None), slot, lora_id, start, end)
    if not spans or spans[0]["start"] != start or spans[-1]["end"] != end:
        # No labels reported (should not happen once the output processor is patched).
        spans = [{"start": start, "end": end, "slot": slot, "version": slot_version(None, lora_id)}]
    return spans, end


def _carries_tokens(choice: dict) -> bool:
    if choice.get("finish_reason") is not None or choice.get("text"):
        return True
    delta = choice.get("delta") or {}
    return bool(
        delta.get("content")
        or delta.get("reasoning")
        or delta.get("tool_calls")
        or delta.get("reasoning_content")
    )


def wrap_stream_generator(original, index_of):
    """`index_of(request, item, output)` gives the choice index of an output."""
    sig = inspect.signature(original)

    @functools.wraps(original)
    async def stream(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        request = bound.arguments["request"]
        state = api_server_state(self)
        alias = state.pending_aliases.pop(request.request_id, None) if state else None
        pending: dict[int, list[dict]] = defaultdict(list)
        produced: dict[int, int] = defaultdict(int)
        source = bound.arguments["result_generator"]

        async def capture():
            async for item in source:
                res = item[1] if isinstance(item, tuple) else item
                for output in res.outputs:
                    idx = index_of(request, item, output)
                    spans, produced[idx] = _new_token_spans(output, res.lora_request, produced[idx])
                    extend_spans(pending[idx], spans)
                yield item

        bound.arguments["result_generator"] = capture()
        async for chunk in original(*bound.args, **bound.kwargs):
            if not chunk.startswith("data: {"):
                yield chunk
                continue
            payload = json.loads(chunk[len("data: ") :])
            changed = False
            for choice in payload.get("choices") or ():
                idx = choice.get("index", 0)
                if pending.get(idx) and _carries_tokens(choice):
                    choice["policy_spans"], pending[idx] = pending[idx], []
                    changed = True
                    bad = alias and next(
                        (s for s in choice["policy_spans"] if s["version"] != alias.version), None
                    )
                    if bad:
                        message = (
                            f"{alias.name} was replaced by {alias.slot}@{bad['version']} "
                            "during generation; stream ended"
                        )
                        yield (
                            "data: "
                            + json.dumps(
                                {"error": {"message": message, "type": "Conflict", "code": 409}}
                            )
                            + "\n\n"
                        )
                        yield "data: [DONE]\n\n"
                        return
            yield (
                "data: " + json.dumps(payload, separators=(",", ":")) + "\n\n" if changed else chunk
            )

    return stream


def completion_stream_spans(original):
    """Wrapper for `completion_stream_generator` (choice index: prompt * n + output)."""
    return wrap_stream_generator(
        original, lambda request, item, output: output.index + item[0] * (request.n or 1)
    )


def chat_stream_spans(original):
    """Wrapper for `chat_completion_stream_generator`."""
    return wrap_stream_generator(original, lambda request, item, output: output.index)


def spans_so_far(original):
    """Wrapper for `RequestState._new_completion_output`: every output carries its spans so
    far (vLLM reports them on the final output only)."""

    @functools.wraps(original)
    def new_completion_output(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if out.weight_versions is None:
            out.weight_versions = compat.weight_version_spans_so_far(self)
        return out

    return new_completion_output
