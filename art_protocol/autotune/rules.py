"""`decide(window, settings, config) -> Decision`: the tuner's rules, as one pure function.

Same inputs, same decision (the packing estimate draws from a generator seeded by the config's
seed and the window's last step). Every knob's move is bounded (`TunerConfig.*_step_fraction`)
and clamped to its hard bounds; every decision carries its inputs and a reason per knob.

Rules, in order:
1. Degraded window (hold mode only) or warm-up (fewer than `warmup_steps` steps since this
   run's first step, resumed runs included): hold everything.
2. Workers. Staleness: more than `stale_tolerance` of the offered groups discarded as older
   than the policy-age limit: remove, unless the trainer is underfed (then rollouts span too
   many short steps, and fewer workers would shorten them further: hold, and let the target
   grow). Else queue full (workers blocked on put for
   `queue_full_fraction` of their time): hold, the trainer is the bottleneck. Else trainer
   underfed (waiting `underfed_fraction` of its step) and the server has headroom (running
   below `headroom_running_fraction` of `max_num_seqs`, KV below `headroom_kv_usage`, nobody
   waiting for capacity, no preemption): add, but only as many as keep the predicted oldest
   token (observed max age x new / current workers: an underfed trainer steps as fast as groups
   arrive) within `staleness_margin * policy_age_limit`. Underfed without headroom: hold
   (more workers would only queue at the server).
3. Target batch: for R in {current rows - 1, current, + 1, x 1.5, x 2, x 3}, the packing
   estimate gives the largest G whose probability of needing more than R rows is at most
   `spill_bound`; the model (`model.py`) picks the R with the best predicted score.
   `max_batch_groups = target` (taking more would spill into an extra row),
   `min_batch_groups = ceil(target / 2)`.
4. Queue capacity: what the trainer consumes in the steps a group may still wait before its
   oldest token reaches the policy-age limit: `target * max(1, limit - 1 - rollout steps)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from art_protocol.autotune.config import KNOBS, Settings, TunerConfig
from art_protocol.autotune.model import fit_step_cost, predict
from art_protocol.autotune.packing_estimate import groups_fitting
from art_protocol.autotune.window import Window


@dataclass(frozen=True)
class Decision:
    step: int
    previous: Settings
    settings: Settings
    reasons: dict[str, str]
    inputs: dict
    degraded: bool = False
    predictions: list[dict] = field(default_factory=list)

    @property
    def changed(self) -> dict[str, tuple[int, int]]:
        return {
            k: (getattr(self.previous, k), getattr(self.settings, k))
            for k in KNOBS
            if getattr(self.previous, k) != getattr(self.settings, k)
        }

    def as_dict(self) -> dict:
        return {
            "step": self.step,
            "previous": self.previous.as_dict(),
            "settings": self.settings.as_dict(),
            "reasons": dict(self.reasons),
            "inputs": self.inputs,
            "degraded": self.degraded,
            "predictions": self.predictions,
        }

    def summary(self) -> str:
        """One line for a training loop's log."""
        moves = ", ".join(f"{k} {a}->{b}" for k, (a, b) in self.changed.items()) or "hold"
        why = "; ".join(f"{k}: {v}" for k, v in self.reasons.items())
        return f"autotune step {self.step}: {moves} ({why})"


def _bounded(current: int, wanted: int, fraction: float, low: int, high: int) -> int:
    """Move from `current` toward `wanted` by at most max(1, ceil(fraction * current))."""
    limit = max(1, math.ceil(fraction * current))
    moved = current + max(-limit, min(limit, wanted - current))
    return max(low, min(high, moved))


def _hold(window: Window, settings: Settings, reason: str, degraded: bool = False) -> Decision:
    return Decision(
        step=window.last_step,
        previous=settings,
        settings=settings,
        reasons={k: reason for k in KNOBS},
        inputs=window.inputs(),
        degraded=degraded,
    )


def _workers(window: Window, settings: Settings, config: TunerConfig) -> tuple[int, str]:
    now = settings.rollout_workers
    low, cap = config.min_rollout_workers, config.max_rollout_workers
    limit = config.policy_age_limit
    if window.stale_fraction > config.stale_tolerance:
        if window.wait_fraction >= config.underfed_fraction:
            return now, (
                f"staleness ({window.stale_fraction:.0%} stale) while the trainer is underfed: "
                f"rollouts span too many short steps; hold (the target batch grows instead)"
            )
        new = _bounded(now, low, config.worker_step_fraction, low, cap)
        return new, (
            f"staleness: {window.stale_fraction:.0%} of groups discarded as older than the "
            f"policy-age limit {limit} (tolerance {config.stale_tolerance:.0%}): remove"
        )
    if window.put_wait_fraction >= config.queue_full_fraction:
        return now, f"queue full ({window.put_wait_fraction:.0%} of worker time blocked): hold"
    if window.wait_fraction < config.underfed_fraction:
        return now, f"trainer fed (waits {window.wait_fraction:.0%} of its steps): hold"
    full = []
    if window.running_fraction >= config.headroom_running_fraction:
        full.append(f"running {window.running_fraction:.0%} of max_num_seqs")
    if window.kv_cache_usage >= config.headroom_kv_usage:
        full.append(f"KV cache {window.kv_cache_usage:.0%} used")
    if window.waiting_for_capacity >= 0.5:
        full.append(f"{window.waiting_for_capacity:.1f} requests waiting for capacity")
    if window.preemptions:
        full.append(f"{window.preemptions} preemptions")
    if full:
        return now, f"trainer underfed but server full ({', '.join(full)}): hold"
    # an underfed trainer steps as fast as groups arrive, so ages scale with the worker count:
    # add no more than keeps the predicted oldest token within the limit
    wanted = cap
    if window.max_policy_age > 0:
        wanted = min(cap, math.floor(now * config.staleness_margin * limit / window.max_policy_age))
    if wanted <= now:
        return now, (
            f"trainer underfed, but more workers would push the predicted max policy age "
            f"past {config.staleness_margin * limit:.1f} (now {window.max_policy_age:.1f}): hold"
        )
    new = _bounded(now, wanted, config.worker_step_fraction, low, cap)
    capped = " (at the absolute worker cap)" if new == cap else ""
    return new, (
        f"trainer underfed (waits {window.wait_fraction:.0%}), server has headroom "
        f"(running {window.running_fraction:.0%}), predicted max policy age "
        f"{window.max_policy_age * new / now:.1f} <= {config.staleness_margin * limit:.1f}: "
        f"add{capped}"
    )


def _target(
    window: Window, settings: Settings, config: TunerConfig, workers: int
) -> tuple[int, str, list[dict]]:
    now = settings.target_groups
    cost = fit_step_cost(window.train_points)
    if not window.shapes or cost is None or window.tokens_per_group <= 0:
        return now, "no trained groups with shapes yet: hold", []
    rng = np.random.default_rng([config.seed, window.last_step])
    current_rows = max(1, round(window.rows_per_step))
    predictions = []
    candidates = sorted(
        {
            max(1, current_rows - 1),
            current_rows,
            current_rows + 1,
            math.ceil(1.5 * current_rows),
            2 * current_rows,
            3 * current_rows,
        }
    )
    for rows in candidates:
        fit = groups_fitting(
            window.shapes,
            rows,
            config.seq_len,
            config.spill_bound,
            rng,
            samples=config.packing_samples,
            max_groups=config.max_batch_ceiling,
        )
        pred = predict(
            rows,
            fit.groups,
            cost,
            workers=workers,
            rollout_s=window.rollout_s,
            observed_cycle_s=window.cycle_s,
            update_s=window.update_s,
            accepted_fraction=window.accepted_fraction,
            stale_fraction=window.stale_fraction,
            tokens_per_group=window.tokens_per_group,
            rollouts_per_group=config.rollouts_per_group,
            tau=config.freshness_tau,
            batch_c=config.batch_c,
        )
        predictions.append(
            {
                "rows": rows,
                "groups": fit.groups,
                "spill": fit.spill_probability,
                "cycle_s": pred.cycle_s,
                "value": pred.value,
            }
        )
    best = max(predictions, key=lambda p: p["value"])
    if best["groups"] < 1:
        return now, "no batch fits one row within the spill bound: hold", predictions
    low, high = config.min_batch_floor, config.max_batch_ceiling
    new = _bounded(now, best["groups"], config.batch_step_fraction, low, high)
    return (
        new,
        (
            f"packing: {best['groups']} groups fit {best['rows']} rows (spill <= "
            f"{config.spill_bound:.0%}), best predicted score of rows {current_rows - 1 or 1}.."
            f"{current_rows + 1} (fixed cost {cost.overhead_s:.2f}s + {cost.per_row_s:.2f}s/row)"
        ),
        predictions,
    )


def _queue(window: Window, settings: Settings, config: TunerConfig, target: int) -> tuple[int, str]:
    rollout_steps = window.rollout_s / window.cycle_s if window.cycle_s > 0 else 0.0
    room_steps = max(1, config.policy_age_limit - 1 - math.ceil(rollout_steps))
    wanted = target * room_steps
    new = _bounded(
        settings.queue_capacity,
        wanted,
        config.queue_step_fraction,
        config.min_queue_capacity,
        config.max_queue_capacity,
    )
    return new, (
        f"policy-age bound: {target} groups/step x {room_steps} steps a group may wait "
        f"(limit {config.policy_age_limit}, rollouts span {rollout_steps:.1f} steps)"
    )


def decide(window: Window, settings: Settings, config: TunerConfig) -> Decision:
    """The next settings for this window (see the module docstring for the rules)."""
    config.check(settings, "current settings")
    if window.degraded:
        return _hold(window, settings, "degraded window: " + "; ".join(window.degraded), True)
    if window.steps_since_start < config.warmup_steps:
        return _hold(
            window,
            settings,
            f"warm-up: {window.steps_since_start} of {config.warmup_steps} steps since this "
            f"run's first step {window.last_step - window.steps_since_start + 1}",
        )
    workers, why_workers = _workers(window, settings, config)
    target, why_target, predictions = _target(window, settings, config, workers)
    min_batch = max(config.min_batch_floor, math.ceil(target / 2))
    queue, why_queue = _queue(window, settings, config, target)
    new = Settings(
        rollout_workers=workers,
        min_batch_groups=min_batch,
        max_batch_groups=target,
        target_groups=target,
        queue_capacity=queue,
    )
    config.check(new, "decided settings")
    return Decision(
        step=window.last_step,
        previous=settings,
        settings=new,
        reasons={
            "rollout_workers": why_workers,
            "target_groups": why_target,
            "min_batch_groups": "half the target (the fewest a draining loop trains on)",
            "max_batch_groups": "the target: more groups would spill into an extra row",
            "queue_capacity": why_queue,
        },
        inputs=window.inputs(),
        predictions=predictions,
    )
