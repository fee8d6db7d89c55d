"""How stale a rollout is, and what it is worth to the trainer (pure functions).

A choice's `policy_spans` say which policy version sampled each token. Given the trainer's
current version, a token's *age* is `current - version` (steps behind). A span also says which
base weights made it (`base_version`, absent = 0); a trainer of full weights passes its current
base version too (`current_base`), and the age counts both: `(current - version) +
(current_base - base_version)`, the updates of either kind the token is behind (a LoRA-only
run leaves both base numbers 0, a full-weight run without adapters leaves the slot numbers
0). From that:

- `policy_age(spans, current)`: the token-weighted mean age.
- `freshness(spans, current, tau=8)`: the discount `1 / E_token[exp(age / tau)]`, 1.0 for a
  rollout made entirely by the current policy and falling smoothly with staleness; a long old
  tail weighs in through the exponential, not just its share of tokens.
- `throughput_score(...)`: `accepted_train_tokens_per_s * freshness * batch_factor`, with
  `batch_factor = (ref_groups + C / ref_rollouts_per_group) / (groups + C / rollouts_per_group)`
  (C = 300; 1.0 without a reference), to compare rollout configurations fairly.

A token from a version newer than `current` is an error: the trainer cannot have been
overtaken by its own rollouts. A choice with no tokens has age 0 and freshness 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

DEFAULT_TAU = 8.0
DEFAULT_BATCH_C = 300.0


class FutureVersionError(ValueError):
    """A span claims a policy version newer than the trainer's current one."""


def _spans(choice_or_spans: Mapping[str, Any] | Iterable[Mapping[str, Any]]):
    if isinstance(choice_or_spans, Mapping):
        return choice_or_spans.get("policy_spans") or []
    return list(choice_or_spans)


def _ages(spans, current: int, current_base: int = 0) -> list[tuple[int, int]]:
    """(age, token count) per span."""
    out = []
    for span in spans:
        version, count = span["version"], span["end"] - span["start"]
        base = span.get("base_version", 0)
        if version > current:
            raise FutureVersionError(
                f"span {dict(span)} has version {version}, newer than the trainer's {current}"
            )
        if base > current_base:
            raise FutureVersionError(
                f"span {dict(span)} has base_version {base}, newer than the trainer's base "
                f"weights {current_base}"
            )
        out.append((current - version + current_base - base, count))
    return out


def policy_age(choice_or_spans, current: int, current_base: int = 0) -> float:
    ages = _ages(_spans(choice_or_spans), current, current_base)
    tokens = sum(n for _, n in ages)
    return sum(a * n for a, n in ages) / tokens if tokens else 0.0


def freshness(
    choice_or_spans, current: int, tau: float = DEFAULT_TAU, current_base: int = 0
) -> float:
    if tau <= 0:
        raise ValueError(f"tau must be positive, got {tau}")
    ages = _ages(_spans(choice_or_spans), current, current_base)
    tokens = sum(n for _, n in ages)
    if not tokens:
        return 1.0
    return tokens / sum(n * math.exp(a / tau) for a, n in ages)


def batch_factor(
    groups: int,
    rollouts_per_group: int,
    ref_groups: int | None = None,
    ref_rollouts_per_group: int | None = None,
    c: float = DEFAULT_BATCH_C,
) -> float:
    if ref_groups is None or ref_rollouts_per_group is None:
        return 1.0
    if min(groups, rollouts_per_group, ref_groups, ref_rollouts_per_group) <= 0:
        raise ValueError("group counts and rollouts per group must be positive")
    return (ref_groups + c / ref_rollouts_per_group) / (groups + c / rollouts_per_group)


def throughput_score(
    accepted_train_tokens_per_s: float,
    fresh: float,
    groups: int,
    rollouts_per_group: int,
    ref_groups: int | None = None,
    ref_rollouts_per_group: int | None = None,
    c: float = DEFAULT_BATCH_C,
) -> float:
    return (
        accepted_train_tokens_per_s
        * fresh
        * batch_factor(groups, rollouts_per_group, ref_groups, ref_rollouts_per_group, c)
    )
