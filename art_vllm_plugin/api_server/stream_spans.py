"""Policy spans on streaming responses (`stream: true`) of completions and chat.

Each SSE chunk that reports tokens of a choice carries `policy_spans` for the tokens that
arrived since the choice's previous spans: half-open ranges in the choice's own token
positions (0 = its first completion token), so concatenating a choice's chunk spans (merging
neighbours of equal version) gives exactly the non-streaming `policy_spans` of the same
generation. With `n > 1` every choice index has its own.

How: vLLM keeps per-request weight-version starts in the output processor but only reports
them on the final output. We attach the spans-so-far to every output (vLLM's `RequestState`,
through `compat`), wrap the stream generator's `result_generator` to turn each delta into
spans for its new tokens, and splice those into the next chunk the generator yields for that
choice (`chunk_splice`: the chunk is not parsed or re-serialised).

Errors end the stream in vLLM's own streaming error format (an `{"error": ...}` event, then
`[DONE]`):
- tokens without a label: the same error a non-streaming answer gets (`policy_spans` raises;
  vLLM's generator turns it into the event), never a made-up version;
- a stream on an exact alias (`slot@N`) whose tokens turn out to come from another version:
  409;
- spans that found no chunk to ride on by the end (vLLM changed how it writes chunks): 500,
  instead of a stream that silently lacks provenance.
"""

from __future__ import annotations

import functools
import inspect
from collections import defaultdict

from art_protocol.provenance import extend_spans, policy_spans
from art_vllm_plugin import compat
from art_vllm_plugin.api_server import chunk_splice, label_test_hook
from art_vllm_plugin.api_server.state import api_server_state
from art_vllm_plugin.compat.api_server import request_state_external_id, streaming_error_event


def _new_token_spans(output, lora_request, produced: int) -> tuple[list[dict], int]:
    """Spans of this delta's tokens, given how many tokens the choice had before.

    The output carries the labels of all its tokens so far; they must cover them exactly as a
    whole answer's must (`policy_spans` raises the same error otherwise)."""
    new = len(output.token_ids)
    if not new:
        return [], produced
    slot = lora_request.lora_name if lora_request is not None else None
    lora_id = lora_request.lora_int_id if lora_request is not None else None
    end = produced + new
    spans = []
    for span in policy_spans(getattr(output, "weight_versions", None), end, slot, lora_id):
        if span["end"] > produced:
            spans.append({**span, "start": max(span["start"], produced)})
    return spans, end


def _replaced_alias(alias, spans: list[dict]) -> str | None:
    bad = next((s for s in spans if s["version"] != alias.version), None)
    if bad is None:
        return None
    return (
        f"{alias.name} was replaced by {alias.slot}@{bad['version']} during generation; "
        "stream ended"
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
            try:
                async for item in source:
                    res = item[1] if isinstance(item, tuple) else item
                    for output in res.outputs:
                        idx = index_of(request, item, output)
                        spans, produced[idx] = _new_token_spans(
                            output, res.lora_request, produced[idx]
                        )
                        extend_spans(pending[idx], spans)
                    yield item
            finally:
                # Raised (labels missing) or abandoned: the engine requests end with us.
                aclose = getattr(source, "aclose", None)
                if aclose is not None:
                    await aclose()

        bound.arguments["result_generator"] = capture()
        chunks = original(*bound.args, **bound.kwargs)
        failed = False
        try:
            async for chunk in chunks:
                if chunk_splice.is_error(chunk):
                    failed = True
                elif chunk_splice.is_done(chunk) and not failed and any(pending.values()):
                    left = {i: s for i, s in pending.items() if s}
                    yield streaming_error_event(
                        f"policy spans {left} found no chunk to ride on; refusing to end the "
                        "stream without provenance for those tokens",
                        "InternalServerError",
                        500,
                    )
                elif (found := chunk_splice.token_chunk(chunk)) and pending.get(found.index):
                    spans, pending[found.index] = pending[found.index], []
                    if alias and (message := _replaced_alias(alias, spans)):
                        yield streaming_error_event(message, "Conflict", 409)
                        yield chunk_splice.DONE + "\n\n"
                        return
                    chunk = chunk_splice.splice(chunk, found.at, spans)
                yield chunk
        finally:
            await chunks.aclose()

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
    far (vLLM reports them on the final output only). On a server with ART_TEST_HOOKS=1, a
    marked request loses labels here (`label_test_hook`)."""
    test_hook = label_test_hook.enabled()

    @functools.wraps(original)
    def new_completion_output(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if out.weight_versions is None:
            out.weight_versions = compat.weight_version_spans_so_far(self)
        if test_hook:
            out.weight_versions = label_test_hook.clip_labels(
                request_state_external_id(self), out.weight_versions
            )
        return out

    return new_completion_output
