"""The six synthetic workloads (shaped like the seed's) and the fixed defaults they are scored
against. Every parameter of the simulation is here.

Lengths are tokens, drawn per rollout from a lognormal with the given median and sigma,
clipped to [low, high]; times are seconds. A multi-turn rollout has `turns` assistant turns,
each followed (except the last) by a tool call of `tool_latency_s` (uniform range) that
returns `tool_tokens` tokens of context. Trainable tokens are the assistant turns.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from art_protocol.autotune import Settings, TunerConfig

from .server import ServerParams


@dataclass(frozen=True)
class Lengths:
    median: float
    sigma: float
    low: int
    high: int


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    rollouts_per_group: int
    prompt: Lengths  # shared by the group's rollouts
    completion: Lengths  # per assistant turn
    server: ServerParams
    seq_len: int  # packed training row
    train_tok_s: float  # trainer throughput over packed slots (padding costs too)
    step_overhead_s: float  # optimizer step, logging, batch preparation
    save_s: float  # adapter export before the update is published (trainer blocked)
    zero_variance_p: float  # share of groups whose rewards are all equal (discarded)
    turns: tuple[int, int] = (1, 1)  # assistant turns per rollout, uniform inclusive
    tool_tokens: Lengths | None = None
    tool_latency_s: tuple[float, float] = (0.0, 0.0)
    policy_age_limit: int = 4
    steps: int = 40
    seed_ratio: float = 1.0  # the seed's fixed -> autotuned ratio for this shape
    notes: str = field(default="", compare=False)


def _server(**overrides) -> ServerParams:
    base = ServerParams(
        max_num_seqs=256,
        kv_capacity_tokens=2_000_000,
        single_tok_s=80.0,
        alpha=0.6,
        prefill_cost=0.02,
        update_latency_s=1.0,
    )
    return replace(base, **overrides)


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            "single_turn_tool",
            "Single-turn tool/history",
            8,
            prompt=Lengths(2000, 0.3, 800, 4000),
            completion=Lengths(350, 0.6, 60, 2000),
            server=_server(),
            seq_len=16384,
            train_tok_s=40_000,
            step_overhead_s=3.0,
            save_s=1.0,
            zero_variance_p=0.25,
            seed_ratio=1.20,
            notes="long tool schemas + history prompt, medium answers",
        ),
        Workload(
            "long_generation",
            "Long generation",
            8,
            prompt=Lengths(300, 0.3, 100, 800),
            completion=Lengths(4000, 0.5, 800, 15000),
            server=_server(kv_capacity_tokens=1_500_000),
            seq_len=32768,
            train_tok_s=40_000,
            step_overhead_s=3.0,
            save_s=1.0,
            zero_variance_p=0.1,
            seed_ratio=1.65,
            notes="generation-bound: long decodes, KV capacity matters",
        ),
        Workload(
            "shared_prefix",
            "Shared-prefix packing",
            16,
            prompt=Lengths(6000, 0.2, 3000, 9000),
            completion=Lengths(150, 0.5, 30, 600),
            server=_server(),
            seq_len=16384,
            train_tok_s=40_000,
            step_overhead_s=3.0,
            save_s=1.0,
            zero_variance_p=0.3,
            seed_ratio=1.02,
            notes="a long prompt stored once per group dominates the packed rows",
        ),
        Workload(
            "multi_turn_agent",
            "Multi-turn agent",
            4,
            prompt=Lengths(1200, 0.3, 400, 3000),
            completion=Lengths(200, 0.6, 30, 1000),
            server=_server(),
            seq_len=32768,
            train_tok_s=40_000,
            step_overhead_s=3.0,
            save_s=1.0,
            zero_variance_p=0.2,
            turns=(3, 8),
            tool_tokens=Lengths(250, 0.6, 20, 1500),
            tool_latency_s=(0.5, 3.0),
            seed_ratio=1.14,
            notes="tool latency between turns; histories grow",
        ),
        Workload(
            "short_single_turn",
            "Short single-turn",
            8,
            prompt=Lengths(150, 0.3, 40, 400),
            completion=Lengths(80, 0.6, 10, 400),
            server=_server(),
            seq_len=16384,
            train_tok_s=40_000,
            step_overhead_s=3.0,
            save_s=1.0,
            zero_variance_p=0.3,
            seed_ratio=1.61,
            notes="tiny trajectories: fixed per-step costs dominate small batches",
        ),
        Workload(
            "weight_update_bound",
            "Weight-update-bound",
            8,
            prompt=Lengths(500, 0.3, 150, 1500),
            completion=Lengths(250, 0.6, 30, 1200),
            server=_server(update_latency_s=15.0),
            seq_len=16384,
            train_tok_s=40_000,
            step_overhead_s=3.0,
            save_s=4.0,
            zero_variance_p=0.2,
            seed_ratio=2.32,
            notes="each in-flight update stalls decoding 15 s (large adapter, slow link)",
        ),
    )
}

#: The fixed "reasonable defaults" every workload is scored with (ART-like: 16 workers, the
#: trainer starts at 4 queued groups and takes up to 40 = 10 x min, a 32-group queue).
FIXED_DEFAULTS = Settings(
    rollout_workers=16, min_batch_groups=4, max_batch_groups=40, target_groups=4, queue_capacity=32
)
#: A deliberately bad fixed setting (tests): one worker, one group per step.
BAD_SETTINGS = Settings(
    rollout_workers=1, min_batch_groups=1, max_batch_groups=1, target_groups=1, queue_capacity=1
)
#: The batch-factor reference: 8 groups of the workload's rollouts per group.
REF_GROUPS = 8


def tuner_config(workload: Workload, seed: int = 0, **overrides) -> TunerConfig:
    """The tuner's config for a workload: what a user states (policy-age limit, row length,
    rollouts per group), an absolute cap of 128 workers, and 16 packing samples per estimate
    (for speed; the spill quantile is then the minimum); the rest are library defaults."""
    return TunerConfig(
        max_rollout_workers=128,
        policy_age_limit=workload.policy_age_limit,
        seq_len=workload.seq_len,
        rollouts_per_group=workload.rollouts_per_group,
        max_batch_ceiling=256,
        packing_samples=16,
        seed=seed,
        **overrides,
    )
