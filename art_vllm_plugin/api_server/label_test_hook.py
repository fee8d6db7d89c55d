"""Test-only: make a request's weight-version labels go missing, deterministically.

Why: a token without a label should never happen (every engine step is labelled), so the
answer to it (an error naming the problem, the same for streamed and whole answers, never a
made-up version) can only be tested by making it happen. Only on a server started with
`ART_TEST_HOOKS=1`, and only for a request whose id carries `MARKER` followed by a token count
K (`"request_id": "art-test-labels-until-3-<anything>"`): its outputs report labels for its
first K tokens and none after, as if the engine had stopped labelling its steps.

Applied in the API server, on each output as the output processor builds it (`stream_spans`
`spans_so_far`), so streamed and whole answers see the same missing labels.
"""

from __future__ import annotations

import os

from art_vllm_plugin.compat.api_server import weight_version_span

TEST_HOOKS_ENV = "ART_TEST_HOOKS"
MARKER = "art-test-labels-until-"


def enabled() -> bool:
    return os.environ.get(TEST_HOOKS_ENV) == "1"


def labelled_tokens(request_id: str) -> int | None:
    """K when `request_id` carries the marker, else None."""
    at = request_id.find(MARKER)
    if at < 0:
        return None
    digits = at + len(MARKER)
    end = digits
    while end < len(request_id) and request_id[end].isdigit():
        end += 1
    return int(request_id[digits:end]) if end > digits else None


def clip_labels(request_id: str, weight_versions):
    """The labels a marked request keeps: those of its first K tokens (None when none)."""
    keep = labelled_tokens(request_id)
    if keep is None or not weight_versions:
        return weight_versions
    kept = [
        weight_version_span(wv.version, wv.start, min(wv.end, keep))
        for wv in weight_versions
        if wv.start < keep
    ]
    return kept or None
