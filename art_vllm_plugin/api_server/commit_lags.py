"""Test-only: the next commit call to an engine is sent late (`POST /art/v1/test/fault`
`{"kind": "lag", "engine": D, "seconds": S}`, only with `ART_TEST_HOOKS=1`).

Why: the engines of one update commit at their own next steps, moments apart. Where that
matters (an MoE model's experts across engines: `expert_cut`), a test must make the moment
long enough to be seen, every run: with the commit to engine D held back S seconds, any
forward run between the first engine's commit and D's would be on mixed experts, and the
test's tokens say whether one ran.
"""

from __future__ import annotations

import asyncio

#: dp rank -> seconds the next commit call to it waits (taken by that call).
_LAGS: dict[int, float] = {}


def arm(engine: int, seconds: float) -> None:
    _LAGS[engine] = seconds


async def wait_before_commit(engine: int) -> None:
    seconds = _LAGS.pop(engine, 0.0)
    if seconds:
        await asyncio.sleep(seconds)
