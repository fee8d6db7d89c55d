"""Builders for tuner inputs: a healthy `/art/metrics` snapshot, a step record, a window."""

from __future__ import annotations

from dataclasses import replace

from art_protocol.autotune import GroupShape, Settings, StepRecord, TunerConfig, Window

SHAPES = tuple(GroupShape(1000, (300, 500, 700, 400)) for _ in range(8))


def config(**overrides) -> TunerConfig:
    base = dict(
        max_rollout_workers=40,
        policy_age_limit=4,
        seq_len=8192,
        rollouts_per_group=4,
        warmup_steps=2,
        window_steps=2,
        packing_samples=16,
    )
    base.update(overrides)
    return TunerConfig(**base)


def settings(**overrides) -> Settings:
    base = Settings(
        rollout_workers=8,
        min_batch_groups=2,
        max_batch_groups=8,
        target_groups=4,
        queue_capacity=16,
    )
    return replace(base, **overrides)


def snapshot(**overrides) -> dict:
    base = {
        "schema_version": 2,
        "snapshot_time": 0.0,
        "age_s": 0.0,
        "idle": False,
        "num_running": 10,
        "num_waiting": 0,
        "num_waiting_for_capacity": 0,
        "num_waiting_deferred": 0,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 8192,
        "kv_cache_usage": 0.2,
        "preemptions_total": 0,
        "generation_tokens_per_s": 500.0,
        "slots": {
            "policy": {"version": 3, "updates": 3, "failed_updates": 0, "last_update_ms": 200.0}
        },
    }
    base.update(overrides)
    return base


def record(step: int, **overrides) -> StepRecord:
    base = dict(
        step=step,
        wall_s=10.0,
        wait_s=1.0,
        rollout_s=20.0,
        groups=4,
        packed_rows=2,
        padding_tokens=100,
        stale_discards=0,
        zero_variance_discards=0,
        put_wait_s=0.0,
        accepted_tokens=7600,
        max_policy_age=2.0,
        mean_policy_age=1.0,
        shapes=SHAPES[:4],
    )
    base.update(overrides)
    return StepRecord(**base)


def window(**overrides) -> Window:
    """A fed trainer, a server with headroom, nothing stale, after warm-up."""
    base = dict(
        first_step=10,
        last_step=12,
        steps_since_start=12,
        steps=3,
        cycle_s=10.0,
        wait_fraction=0.02,
        rollout_s=20.0,
        put_wait_fraction=0.0,
        groups_per_step=4.0,
        rows_per_step=2.0,
        accepted_fraction=1.0,
        tokens_per_group=1900.0,
        stale_discards=0,
        stale_fraction=0.0,
        max_policy_age=2.0,
        mean_policy_age=1.0,
        running_fraction=0.2,
        waiting_for_capacity=0.0,
        kv_cache_usage=0.2,
        preemptions=0,
        generation_tokens_per_s=500.0,
        update_s=0.2,
        samples=30,
        train_points=((2, 6.0), (3, 8.0), (2, 6.1)),
        shapes=SHAPES,
    )
    base.update(overrides)
    return Window(**base)
