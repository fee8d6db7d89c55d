"""Route provenance: which policy version selected each returned route row.

The row of token t is produced by the forward that consumed token t; that forward sampled
token t+1. So a row's version is the sampling version of the next token: for row t at or after
the last prompt token (t >= P-1), the version of completion token t+1-P, read from the choice's
`policy_spans`. Prompt rows before that (t < P-1) were computed by the prefill forward (or, for
a prefix-cache hit, by the forward that filled the cached blocks, which the policy-version
cache salt keeps to the same version); they take the version of the first completion token,
the one the prefill sampled.

`route_spans` have the shape of `policy_spans` (`start`, `end`, `slot`, `version`, and
`base_version` when not 0; half-open, contiguous, complete) and count rows of the returned
route array: row 0 is prompt position `routes_prompt_start`.
"""

from __future__ import annotations

from typing import Any

from art_protocol.provenance import extend_spans


def expected_rows(prompt_len: int, completion_len: int, prompt_start: int) -> int:
    """Rows a finished choice has: every token but the last was consumed by a forward."""
    return max(prompt_len + completion_len - 1 - prompt_start, 0)


def route_spans(
    policy_spans: list[dict[str, Any]], prompt_len: int, prompt_start: int, num_rows: int
) -> list[dict[str, Any]]:
    """`policy_spans` over completion tokens -> spans over the returned route rows.

    Raises:
        ValueError: the policy spans do not start at 0 while rows exist (nothing to take the
            prompt rows' version from).
    """
    if num_rows == 0:
        return []
    if not policy_spans or policy_spans[0]["start"] != 0:
        raise ValueError(f"policy spans {policy_spans} do not start at completion token 0")
    # completion token c <- row r = c + P - 1 - prompt_start
    shift = prompt_len - 1 - prompt_start
    out: list[dict[str, Any]] = []
    for index, span in enumerate(policy_spans):
        lo = 0 if index == 0 else span["start"] + shift
        hi = span["end"] + shift
        lo, hi = max(lo, 0), min(hi, num_rows)
        if lo >= hi:
            continue
        # merged like policy spans: contiguous, same slot version and base version
        extend_spans(out, [{**span, "start": lo, "end": hi}])
    if not out or out[-1]["end"] != num_rows:
        raise ValueError(
            f"policy spans {policy_spans} do not cover {num_rows} route rows "
            f"(prompt {prompt_len}, prompt_start {prompt_start})"
        )
    return out
