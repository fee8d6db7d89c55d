"""Benchmark: the autotuner against fixed defaults on six simulated Pipeline RL workloads.

A test harness, not a GPU claim: every number comes from the discrete-event simulator in
`tests/support/pipeline_sim/` (parameters in its `workloads.py`), which models rollout workers
-> an inference server (continuous batching, `max_num_seqs`, KV capacity, sublinear throughput,
in-flight update stalls) -> a bounded queue -> a trainer packing with the project's prefix-tree
packer -> updates. The score is the seed's: accepted trainable tokens/s x freshness (token
policy age, tau 8) x batch factor (C 300, reference 8 groups), over the last 10 of 40 steps,
computed with `art_protocol.policy_age`.

Fixed: the same reasonable defaults for every workload (16 rollout workers, the trainer starts
at 4 queued groups and takes up to 40, a 32-group queue). Tuned: the same start, then the
tuner (`art_protocol.autotune`, absolute cap 128 workers) decides every 3 steps after a
4-step warm-up. Both runs of a seed see the same workload draws.

Run: .venv-serve/bin/python bench/autotune.py [--seeds 5] [--workloads a,b]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT), str(_ROOT / "tests")]

from support.pipeline_sim import (  # noqa: E402
    FIXED_DEFAULTS,
    WORKLOADS,
    run_fixed,
    run_tuned,
    tuner_config,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 (default 5)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    args = parser.parse_args()
    names = args.workloads.split(",")
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; known: {list(WORKLOADS)}")
    print("Simulated (a test harness for the tuner's logic, not a GPU measurement)")
    print(f"fixed defaults: {FIXED_DEFAULTS}")
    header = (
        f"{'workload':26s} {'fixed':>8s} {'tuned':>8s} {'ratio':>6s} {'seed':>6s}  "
        f"{'ratio per seed (min)':s}"
    )
    print(header)
    worst, started, cpu = [], time.perf_counter(), time.process_time()
    for name in names:
        w = WORKLOADS[name]
        fixed, tuned = [], []
        for seed in range(args.seeds):
            fixed.append(run_fixed(w, FIXED_DEFAULTS, seed).score())
            tuned.append(run_tuned(w, FIXED_DEFAULTS, seed, tuner_config(w, seed)).score())
        ratios = [t / f for t, f in zip(tuned, fixed, strict=True)]
        worst.append(min(ratios))
        per_seed = " ".join(f"{r:.2f}" for r in ratios)
        print(
            f"{w.title:26s} {statistics.mean(fixed):8.1f} {statistics.mean(tuned):8.1f} "
            f"{statistics.mean(tuned) / statistics.mean(fixed):5.2f}x {w.seed_ratio:5.2f}x  "
            f"{per_seed} ({min(ratios):.2f})"
        )
    print(
        f"scores: mean over seeds 0..{args.seeds - 1}; 'seed' = the seed PR's ratio for the "
        f"shape; worst seed ratio {min(worst):.3f}; {time.perf_counter() - started:.0f}s wall, "
        f"{time.process_time() - cpu:.0f}s CPU"
    )
    return 0 if min(worst) >= 0.98 else 1


if __name__ == "__main__":
    sys.exit(main())
