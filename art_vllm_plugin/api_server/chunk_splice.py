"""Put `policy_spans` into a streamed chunk by splicing text, without parsing the chunk.

Why: a stream sends one SSE event per token per choice, and with logprobs each event is large.
Parsing it (`json.loads`) and writing it again (`json.dumps`) for one small field costs more
than vLLM spent making it, and rewrites its bytes (non-ASCII text became `\\uXXXX` escapes).
Here the chunk stays exactly as vLLM wrote it, with one field inserted.

What this relies on, in the events vLLM 0.32's completion and chat stream generators write
(`f"data: {model.model_dump_json(exclude_unset=True)}\\n\\n"`, compact JSON, one choice per
event: `choices=[choice_data]`):

- the event's choice starts with `"choices":[{"index":N` (`index` is the first field of both
  `CompletionResponseStreamChoice` and `ChatCompletionResponseStreamChoice`; the fields
  before `choices` are plain strings and numbers);
- an event that reports tokens has a `"token_ids":` field in its choice (both generators set
  `token_ids` explicitly on every output chunk, `null` unless `return_token_ids`); chat's
  role and echo chunks, which carry no generated token, do not.

A structural pattern such as `"token_ids":` cannot occur inside a JSON string, where every
quote is escaped. The spans go in right after the index value, so the choice reads
`{"index":N,"policy_spans":[...],...}`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

DONE = "data: [DONE]"
_CHOICE = '"choices":[{"index":'
_TOKENS = '"token_ids":'
_EVENT = "data: {"
_ERROR = 'data: {"error"'


@dataclass(frozen=True)
class TokenChunk:
    """A chunk that reports tokens of choice `index`; the spans go in at `at`."""

    index: int
    at: int


def token_chunk(chunk: str) -> TokenChunk | None:
    """Which choice `chunk` reports tokens for, or None: `[DONE]`, error events, usage
    chunks (`"choices":[]`), chat's role and echo chunks, keep-alive comments."""
    if not chunk.startswith(_EVENT):
        return None
    start = chunk.find(_CHOICE)
    if start < 0:
        return None
    digits = start + len(_CHOICE)
    end = digits
    while end < len(chunk) and chunk[end].isdigit():
        end += 1
    if end == digits or chunk.find(_TOKENS, end) < 0:
        return None
    return TokenChunk(int(chunk[digits:end]), end)


def spans_json(spans: list[dict]) -> str:
    """Compact JSON of spans, non-ASCII as is (as vLLM writes its events)."""
    return json.dumps(spans, separators=(",", ":"), ensure_ascii=False)


def splice(chunk: str, at: int, spans: list[dict]) -> str:
    """`chunk` with `"policy_spans":[...]` inserted at `at` (from `token_chunk`)."""
    return f'{chunk[:at]},"policy_spans":{spans_json(spans)}{chunk[at:]}'


def is_done(chunk: str) -> bool:
    return chunk.startswith(DONE)


def is_error(chunk: str) -> bool:
    """vLLM's streaming error event (`{"error": {...}}`, `json.dumps` spacing)."""
    return chunk.startswith(_ERROR)
