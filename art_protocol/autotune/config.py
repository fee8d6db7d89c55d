"""What the tuner may move (`Settings`) and within which hard bounds (`TunerConfig`).

Why typed and bounded: the tuner runs unattended for days. Every knob has a floor and a
ceiling here, the worker count an absolute cap (repeated underfed windows must not grow the
fleet without end), and each decision moves a knob by a bounded step. A setting outside its
bounds is an error naming the knob and the bound, never silently clamped on the way in.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Literal

KNOBS = (
    "rollout_workers",
    "min_batch_groups",
    "max_batch_groups",
    "target_groups",
    "queue_capacity",
)


class SettingsError(ValueError):
    """Settings (or a profile's settings) outside the config's bounds; names the knob."""


@dataclass(frozen=True)
class Settings:
    """The pipeline's knobs. The trainer starts a step once `target_groups` are queued (or
    `min_batch_groups` after its grace period) and takes at most `max_batch_groups`; rollout
    workers block when `queue_capacity` groups are queued."""

    rollout_workers: int
    min_batch_groups: int
    max_batch_groups: int
    target_groups: int
    queue_capacity: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Settings:
        missing = [k for k in KNOBS if k not in data]
        if missing:
            raise SettingsError(f"settings lack {', '.join(missing)}")
        return cls(**{k: int(data[k]) for k in KNOBS})


@dataclass(frozen=True)
class TunerConfig:
    """Hard bounds, step limits, rule thresholds and the metrics contract.

    Bounds: `max_rollout_workers` is the absolute worker cap. Steps: a knob moves by at most
    `max(1, ceil(step_fraction * current))` per decision. Windows: a decision every
    `window_steps` training steps after `warmup_steps` counted from the first step this run
    (a resumed run warms up again). Contract: `/art/metrics` is polled every
    `poll_interval_s`; a metric older than twice that raises (`on_bad_metrics="raise"`) or,
    opted in, holds the settings and reports the window as degraded (`"hold"`).
    """

    max_rollout_workers: int
    policy_age_limit: int  # trajectories with older tokens are discarded by the trainer
    seq_len: int  # tokens per packed training row
    rollouts_per_group: int
    min_rollout_workers: int = 1
    min_batch_floor: int = 1
    max_batch_ceiling: int = 256
    min_queue_capacity: int = 1
    max_queue_capacity: int = 1024
    worker_step_fraction: float = 0.5
    batch_step_fraction: float = 0.5
    queue_step_fraction: float = 1.0
    warmup_steps: int = 4
    window_steps: int = 3
    poll_interval_s: float = 1.0
    on_bad_metrics: Literal["raise", "hold"] = "raise"
    spill_bound: float = 0.03  # allowed P(batch needs one packed row more than planned)
    packing_samples: int = 32
    shape_history: int = 256  # recent group shapes the packing estimate draws from
    underfed_fraction: float = 0.10  # trainer waits this share of a step -> underfed
    queue_full_fraction: float = 0.20  # workers block on put this share of a rollout -> full
    headroom_running_fraction: float = 0.85  # running / max_num_seqs below this -> headroom
    headroom_kv_usage: float = 0.90
    staleness_margin: float = 1.0  # add workers only while predicted max age <= margin * limit
    stale_tolerance: float = 0.05  # remove workers above this share of stale discards
    freshness_tau: float = 8.0
    batch_c: float = 300.0
    seed: int = 0

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"TunerConfig: {what}")

        need(
            self.max_rollout_workers >= self.min_rollout_workers >= 1,
            f"need max_rollout_workers >= min_rollout_workers >= 1, got "
            f"{self.max_rollout_workers} and {self.min_rollout_workers}",
        )
        need(
            self.max_batch_ceiling >= self.min_batch_floor >= 1,
            "need max_batch_ceiling >= min_batch_floor >= 1",
        )
        need(
            self.max_queue_capacity >= self.min_queue_capacity >= 1,
            "need max_queue_capacity >= min_queue_capacity >= 1",
        )
        need(
            self.policy_age_limit >= 1,
            f"policy_age_limit must be >= 1, got {self.policy_age_limit}",
        )
        need(
            self.seq_len >= 1 and self.rollouts_per_group >= 1,
            "seq_len and rollouts_per_group must be >= 1",
        )
        need(0 < self.spill_bound < 1, f"spill_bound must be in (0, 1), got {self.spill_bound}")
        need(self.poll_interval_s > 0, "poll_interval_s must be positive")
        need(
            self.window_steps >= 1 and self.warmup_steps >= 0,
            "window_steps must be >= 1 and warmup_steps >= 0",
        )
        need(
            self.on_bad_metrics in ("raise", "hold"),
            f"on_bad_metrics must be 'raise' or 'hold', got {self.on_bad_metrics!r}",
        )
        for name in ("worker_step_fraction", "batch_step_fraction", "queue_step_fraction"):
            need(getattr(self, name) > 0, f"{name} must be positive")

    def bounds(self) -> dict[str, tuple[int, int]]:
        """(low, high) per knob."""
        return {
            "rollout_workers": (self.min_rollout_workers, self.max_rollout_workers),
            "min_batch_groups": (self.min_batch_floor, self.max_batch_ceiling),
            "max_batch_groups": (self.min_batch_floor, self.max_batch_ceiling),
            "target_groups": (self.min_batch_floor, self.max_batch_ceiling),
            "queue_capacity": (self.min_queue_capacity, self.max_queue_capacity),
        }

    def check(self, settings: Settings, source: str = "settings") -> None:
        """Raise SettingsError naming the first knob outside its bounds or out of order."""
        for knob, (low, high) in self.bounds().items():
            value = getattr(settings, knob)
            if not low <= value <= high:
                cap = " (the absolute worker cap)" if knob == "rollout_workers" else ""
                raise SettingsError(
                    f"{source}: {knob}={value} is outside this config's bounds [{low}, {high}]{cap}"
                )
        s = settings
        if not s.min_batch_groups <= s.target_groups <= s.max_batch_groups:
            raise SettingsError(
                f"{source}: need min_batch_groups <= target_groups <= max_batch_groups, got "
                f"{s.min_batch_groups}, {s.target_groups}, {s.max_batch_groups}"
            )

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
