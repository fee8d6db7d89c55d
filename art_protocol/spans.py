"""The check a trainer runs on a choice's per-token policy spans before it trusts them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class SpanError(ValueError):
    """A choice's policy spans do not describe its tokens exactly once, in order."""


def validate_spans(
    choice: Mapping[str, Any],
    num_tokens: int,
    latest_version: int | Mapping[str, int],
    latest_base_version: int | None = None,
) -> Sequence[Mapping[str, Any]]:
    """Check `choice["policy_spans"]` against its `num_tokens` completion tokens.

    Raises SpanError on a missing field, a gap, an overlap, an empty or out-of-order span, or
    a version newer than `latest_version` (an int, or a mapping slot -> latest version, e.g.
    `ArtClient.latest_versions()`): a token cannot come from a policy the trainer has not
    published. `latest_version` is required so that this check runs in every call; a mapping
    that lacks a span's slot is an error too (base-model spans, slot None, are version 0).

    Base weights: a span's `base_version` (absent = 0, the weights as loaded) must not be
    newer than `latest_base_version`, the last full-weight update the trainer published. A
    span with a base version > 0 needs `latest_base_version` (a trainer of full weights
    passes it; a LoRA-only trainer never sees such spans). Returns the spans.
    """
    if latest_version is None or isinstance(latest_version, bool):
        raise TypeError(
            "validate_spans needs latest_version (an int, or a mapping slot -> latest "
            f"published version), got {latest_version!r}"
        )
    spans = choice.get("policy_spans")
    if spans is None:
        raise SpanError("choice has no policy_spans")
    expected_start = 0
    for i, span in enumerate(spans):
        start, end, version = span.get("start"), span.get("end"), span.get("version")
        if not all(isinstance(v, int) for v in (start, end, version)):
            raise SpanError(f"span {i} {span}: start, end and version must be integers")
        if start < expected_start:
            raise SpanError(f"span {i} {span} overlaps the previous span (ends {expected_start})")
        if start > expected_start:
            raise SpanError(f"gap before span {i} {span}: tokens {expected_start}..{start}")
        if end <= start:
            raise SpanError(f"span {i} {span} is empty or reversed")
        limit = latest_version
        if isinstance(latest_version, Mapping):
            slot = span.get("slot")
            if slot is not None and slot not in latest_version:
                raise SpanError(
                    f"span {i} {span}: slot {slot!r} has no latest version in "
                    f"{dict(latest_version)}"
                )
            limit = latest_version.get(slot, 0)
        if version > limit:
            raise SpanError(
                f"span {i} {span} has version {version}, newer than the latest "
                f"published version {limit}"
            )
        _check_base(i, span, latest_base_version)
        expected_start = end
    if expected_start != num_tokens:
        raise SpanError(f"spans cover {expected_start} tokens, the choice has {num_tokens}")
    return spans


def _check_base(i: int, span: Mapping[str, Any], latest_base_version: int | None) -> None:
    base = span.get("base_version", 0)
    if not isinstance(base, int) or isinstance(base, bool) or base < 0:
        raise SpanError(f"span {i} {span}: base_version must be an integer >= 0")
    if base == 0:
        return
    if latest_base_version is None:
        raise SpanError(
            f"span {i} {span} comes from base weights version {base}: pass "
            "latest_base_version (the last full-weight update published) to check it"
        )
    if base > latest_base_version:
        raise SpanError(
            f"span {i} {span} has base_version {base}, newer than the latest published base "
            f"weights {latest_base_version}"
        )
