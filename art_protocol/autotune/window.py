"""The tuner's inputs: `/art/metrics` samples, trainer step records, and the window of both.

The metrics contract is strict: every field in `REQUIRED_METRICS` must be in every snapshot,
and at a decision every one must have been seen within twice the poll interval. A snapshot
whose engine last stepped longer ago than that is stale too, unless that step left the engine
idle (nothing running or waiting: an idle engine reports no steps). A violation raises
`MetricsContractError` naming the metric; the opt-in "hold" mode reports it instead.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from art_protocol.autotune.packing_estimate import GroupShape

#: `/art/metrics` fields (schema >= 2) every decision needs.
REQUIRED_METRICS = (
    "schema_version",
    "snapshot_time",
    "age_s",
    "idle",
    "num_running",
    "num_waiting",
    "num_waiting_for_capacity",
    "max_num_seqs",
    "kv_cache_usage",
    "preemptions_total",
    "generation_tokens_per_s",
    "slots",
)
MIN_SCHEMA_VERSION = 2


class MetricsContractError(RuntimeError):
    """A required serving metric is missing, malformed or stale; `.metric` names it."""

    def __init__(self, metric: str, message: str):
        super().__init__(message)
        self.metric = metric


def check_snapshot(snapshot: Mapping) -> None:
    """Raise MetricsContractError naming the first required field missing or malformed."""
    for name in REQUIRED_METRICS:
        value = snapshot.get(name) if isinstance(snapshot, Mapping) else None
        if value is None:
            raise MetricsContractError(
                name, f"/art/metrics snapshot lacks required metric '{name}' (schema 2)"
            )
    if snapshot["schema_version"] < MIN_SCHEMA_VERSION:
        raise MetricsContractError(
            "schema_version",
            f"/art/metrics schema_version {snapshot['schema_version']} < {MIN_SCHEMA_VERSION}: "
            "the server's plugin is too old for the autotuner",
        )
    for name in REQUIRED_METRICS[1:]:
        value = snapshot[name]
        ok = isinstance(value, dict) if name == "slots" else isinstance(value, int | float)
        if not ok or (not isinstance(value, dict) and not math.isfinite(value)):
            message = f"/art/metrics metric '{name}' is malformed: {value!r}"
            raise MetricsContractError(name, message)
    if snapshot["max_num_seqs"] < 1:
        raise MetricsContractError("max_num_seqs", "/art/metrics max_num_seqs must be >= 1")


@dataclass(frozen=True)
class MetricsSample:
    """One polled snapshot and when the tuner received it (its clock)."""

    fetched_at: float
    values: Mapping


@dataclass(frozen=True)
class StepRecord:
    """What the trainer reports after each step (times in seconds, per the step).

    `wait_s`: waiting for the batch; `rollout_s`: mean rollout time of the trained groups
    (first request to last token); `put_wait_s`: mean time their workers blocked on a full
    queue; `shapes`: the trained groups' shapes; ages from the tokens' policy spans."""

    step: int
    wall_s: float
    wait_s: float
    rollout_s: float
    groups: int
    packed_rows: int
    padding_tokens: int
    stale_discards: int
    zero_variance_discards: int
    put_wait_s: float
    accepted_tokens: int
    max_policy_age: float
    mean_policy_age: float
    shapes: Sequence[GroupShape] = ()

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name == "shapes":
                continue
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"StepRecord.{name} must be a finite number >= 0, got {value!r}")
        if self.wait_s > self.wall_s:
            raise ValueError(f"StepRecord.wait_s {self.wait_s} exceeds wall_s {self.wall_s}")


@dataclass(frozen=True)
class Window:
    """A decision window's summary; every decision stores it as its inputs."""

    first_step: int
    last_step: int
    steps_since_start: int
    steps: int
    cycle_s: float  # mean wall time per step
    wait_fraction: float  # trainer time spent waiting for batches
    rollout_s: float
    put_wait_fraction: float  # worker time blocked on a full queue
    groups_per_step: float
    rows_per_step: float
    accepted_fraction: float  # accepted / (accepted + stale + zero-variance)
    tokens_per_group: float  # accepted trainable tokens per trained group
    stale_discards: int
    stale_fraction: float  # stale / offered groups
    max_policy_age: float
    mean_policy_age: float
    running_fraction: float  # mean num_running / max_num_seqs
    waiting_for_capacity: float  # mean
    kv_cache_usage: float  # mean
    preemptions: int  # during the window
    generation_tokens_per_s: float
    update_s: float  # mean last in-flight update latency over slots (latest sample)
    samples: int
    train_points: tuple[tuple[int, float], ...] = ()  # (packed rows, busy seconds), recent
    shapes: tuple[GroupShape, ...] = field(default=(), repr=False)
    degraded: tuple[str, ...] = ()

    def inputs(self) -> dict:
        """The summary without the shapes (recorded with each decision)."""
        out = asdict(self)
        out.pop("shapes")
        out["shape_count"] = len(self.shapes)
        out["train_points"] = [list(p) for p in self.train_points]
        out["degraded"] = list(self.degraded)
        return out


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def summarize(
    records: Sequence[StepRecord],
    samples: Sequence[MetricsSample],
    *,
    run_first_step: int,
    train_points: Sequence[tuple[int, float]],
    shapes: Sequence[GroupShape],
    degraded: Sequence[str] = (),
) -> Window:
    """Fold a window's step records and metrics samples into a `Window`."""
    if not records:
        raise ValueError("a window needs at least one step record")
    wall = sum(r.wall_s for r in records)
    rollout = sum(r.rollout_s for r in records)
    put_wait = sum(r.put_wait_s for r in records)
    trained = sum(r.groups for r in records)
    offered = trained + sum(r.stale_discards + r.zero_variance_discards for r in records)
    values = [s.values for s in samples]
    if values:
        preemptions = int(values[-1]["preemptions_total"] - values[0]["preemptions_total"])
        slots = values[-1]["slots"]
        update_ms = [s.get("last_update_ms") or 0.0 for s in slots.values()]
    else:
        preemptions, update_ms = 0, []
    return Window(
        first_step=records[0].step,
        last_step=records[-1].step,
        steps_since_start=records[-1].step - run_first_step + 1,
        steps=len(records),
        cycle_s=wall / len(records),
        wait_fraction=sum(r.wait_s for r in records) / wall if wall else 0.0,
        rollout_s=rollout / len(records),
        put_wait_fraction=put_wait / (rollout + put_wait) if rollout + put_wait else 0.0,
        groups_per_step=trained / len(records),
        rows_per_step=_mean(r.packed_rows for r in records),
        accepted_fraction=trained / offered if offered else 1.0,
        tokens_per_group=sum(r.accepted_tokens for r in records) / trained if trained else 0.0,
        stale_discards=sum(r.stale_discards for r in records),
        stale_fraction=sum(r.stale_discards for r in records) / offered if offered else 0.0,
        max_policy_age=max(r.max_policy_age for r in records),
        mean_policy_age=_mean(r.mean_policy_age for r in records),
        running_fraction=_mean(v["num_running"] / v["max_num_seqs"] for v in values),
        waiting_for_capacity=_mean(v["num_waiting_for_capacity"] for v in values),
        kv_cache_usage=_mean(v["kv_cache_usage"] for v in values),
        preemptions=max(0, preemptions),
        generation_tokens_per_s=_mean(v["generation_tokens_per_s"] for v in values),
        update_s=_mean(update_ms) / 1000.0,
        samples=len(values),
        train_points=tuple(train_points),
        shapes=tuple(shapes),
        degraded=tuple(degraded),
    )
