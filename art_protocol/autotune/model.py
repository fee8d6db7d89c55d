"""The tuner's small throughput model: what a step of R packed rows would cost and yield.

Why a model rather than trial and error: each trial costs several training steps, and the
score moves with noise. The model uses only measured quantities of the window:
- trainer busy time per step `a + b * rows`, fitted on recent (rows, busy) points (with one
  distinct row count, `a = 0`: no evidence of a fixed cost yet);
- rollout time per group, split into active generation and in-flight update stalls (one stall
  of the server's measured update latency per training step while the rollout runs), so a
  longer step means fewer stalls per rollout;
- groups per second = workers / rollout time, times the accepted fraction, whose stale part
  shrinks as the cycle grows (`stale_at`: rollouts span fewer steps);
A step's cycle is the slower of training R rows and producing its G groups; the value of a
candidate is the seed's score up to constants: accepted tokens per second x freshness
(`exp(-mean age / tau)`, mean age about half a rollout in steps) x batch factor
`1 / (G + C / rollouts_per_group)`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepCost:
    """Trainer busy seconds per step: `overhead_s + per_row_s * rows`."""

    overhead_s: float
    per_row_s: float

    def busy_s(self, rows: int) -> float:
        return self.overhead_s + self.per_row_s * rows


def fit_step_cost(points: Sequence[tuple[int, float]]) -> StepCost | None:
    """Least squares over (rows, busy seconds); None without a usable point."""
    pts = [(r, t) for r, t in points if r > 0 and t > 0]
    if not pts:
        return None
    rows = [r for r, _ in pts]
    if len(set(rows)) < 2:
        return StepCost(0.0, sum(t for _, t in pts) / sum(rows))
    n = len(pts)
    mean_r = sum(rows) / n
    mean_t = sum(t for _, t in pts) / n
    var = sum((r - mean_r) ** 2 for r in rows)
    slope = sum((r - mean_r) * (t - mean_t) for r, t in pts) / var
    intercept = mean_t - slope * mean_r
    if slope <= 0:  # noise: fall back to a proportional cost
        return StepCost(0.0, mean_t / mean_r)
    if intercept < 0:
        return StepCost(0.0, sum(t for _, t in pts) / sum(rows))
    return StepCost(intercept, slope)


def stale_at(stale_fraction: float, observed_cycle_s: float, cycle_s: float) -> float:
    """Share of groups older than the limit at another cycle length. A group is stale when
    its rollout outlasts `limit` steps; with an exponential tail of rollout times that share
    is `exp(-limit * cycle / theta)`, so `s(c) = s0 ** (c / c0)` from the observed one."""
    if not 0 < stale_fraction < 1 or observed_cycle_s <= 0:
        return stale_fraction
    return stale_fraction ** (cycle_s / observed_cycle_s)


@dataclass(frozen=True)
class Prediction:
    rows: int
    groups: int
    cycle_s: float
    rollout_s: float
    value: float  # score up to a constant factor


def predict(
    rows: int,
    groups: int,
    cost: StepCost,
    *,
    workers: int,
    rollout_s: float,
    observed_cycle_s: float,
    update_s: float,
    accepted_fraction: float,
    stale_fraction: float,
    tokens_per_group: float,
    rollouts_per_group: int,
    tau: float,
    batch_c: float,
) -> Prediction:
    """The cycle and score value of training `groups` groups in `rows` rows per step."""
    if groups < 1:
        return Prediction(rows, groups, math.inf, rollout_s, 0.0)
    # stalls per rollout ~ rollout_s / cycle (one update per step), each update_s long
    stall_share = min(0.8, update_s / observed_cycle_s) if observed_cycle_s > 0 else 0.0
    active = rollout_s * (1.0 - stall_share)
    cycle = max(observed_cycle_s, 1e-6)
    rollout = rollout_s
    fresh_share = accepted_fraction / max(1e-3, 1.0 - stale_fraction)  # not zero-variance
    stale = stale_fraction
    for _ in range(4):  # fixed point: the cycle sets the stalls, the stalls the production
        rollout = active / max(0.2, 1.0 - min(0.8, update_s / cycle))
        stale = stale_at(stale_fraction, observed_cycle_s, cycle)
        accepted = max(1e-3, fresh_share * (1.0 - stale))
        produce = groups * rollout / (max(1, workers) * accepted)
        cycle = max(cost.busy_s(rows), produce, 1e-6)
    age = 0.5 * rollout / cycle
    value = (
        groups
        * tokens_per_group
        / cycle
        * math.exp(-age / tau)
        / (groups + batch_c / rollouts_per_group)
    )
    return Prediction(rows, groups, cycle, rollout, value)
