"""Benchmark: trajectory groups -> packed rows (with routes), prefix-tree packing.

Two batch shapes:
  single-turn: 64 groups x 8 rollouts, 1k-token prompt, 1-4k-token completions, seq_len 32k.
  multi-turn:  64 chats x 6 histories (history k = prompt + k turns, only the last assistant
               turn trained), 512-token prompt, 200-800-token assistant turns, 100-400-token
               tool/user turns, seq_len 32k.
Routes: [tokens, 48 layers, top-8] uint8 views into one buffer (as a decoded route bundle
gives them), 128 experts.

Reported per shape: wall and CPU time of the whole path (with routes, into fresh route tensors
and into the route tensors of a previous batch, as a trainer reusing them does) and without
routes; rows used against the lower bound ceil(unique tokens / seq_len); packing efficiency
(unique tokens / stored slots); and, as the baseline, the same packer with prefix sharing off
(every trajectory stored whole), whose rows and time are measured in the same run.

Run: .venv-train/bin/python bench/packing.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from art_megatron_ext.packing import PackingConfig, Trajectory, TrajectoryGroup, pack_groups

VOCAB, LAYERS, TOPK, EXPERTS, SEQ_LEN = 151_936, 48, 8, 128, 32_768


def _route_pool(rng, total_tokens):
    pool = rng.integers(0, EXPERTS, size=(total_tokens, LAYERS, TOPK), dtype=np.uint8)
    return pool


def single_turn(rng, with_routes=True):
    prompts = [rng.integers(0, VOCAB, 1024) for _ in range(64)]
    completions = [
        [rng.integers(0, VOCAB, rng.integers(1024, 4097)) for _ in range(8)] for _ in range(64)
    ]
    total = sum(1024 + len(c) for group in completions for c in group)
    pool = _route_pool(rng, total) if with_routes else None
    cursor, groups = 0, []
    for prompt, rollouts in zip(prompts, completions, strict=True):
        members = []
        for completion in rollouts:
            n = 1024 + len(completion)
            mask = np.zeros(n, bool)
            mask[1024:] = True
            logprobs = np.full(n, np.nan, np.float32)
            logprobs[1024:] = -rng.random(len(completion), dtype=np.float32)
            routes = None if pool is None else pool[cursor : cursor + n]
            cursor += n
            members.append(
                Trajectory(
                    tokens=np.concatenate([prompt, completion]),
                    assistant_mask=mask,
                    logprobs=logprobs,
                    advantage=float(rng.normal()),
                    routes=routes,
                )
            )
        groups.append(TrajectoryGroup(members))
    return groups


def multi_turn(rng, with_routes=True, chats=64, turns=6):
    groups = []
    histories = []
    for _ in range(chats):
        pieces = [(rng.integers(0, VOCAB, 512), False)]
        for _ in range(turns):
            pieces.append((rng.integers(0, VOCAB, rng.integers(200, 801)), True))
            pieces.append((rng.integers(0, VOCAB, rng.integers(100, 401)), False))
        histories.append(pieces)
    total = sum(
        sum(len(p) for p, _ in pieces[: 2 * k + 2]) for pieces in histories for k in range(turns)
    )
    pool = _route_pool(rng, total) if with_routes else None
    cursor = 0
    for pieces in histories:
        members = []
        for k in range(turns):
            used = pieces[: 2 * k + 2]  # prompt, (assistant, tool) * k, assistant k
            tokens = np.concatenate([p for p, _ in used])
            n = len(tokens)
            mask = np.zeros(n, bool)
            mask[n - len(used[-1][0]) :] = True  # train only the last assistant turn
            logprobs = np.full(n, np.nan, np.float32)
            logprobs[mask] = -0.5
            routes = None if pool is None else pool[cursor : cursor + n]
            cursor += n
            members.append(
                Trajectory(
                    tokens=tokens,
                    assistant_mask=mask,
                    logprobs=logprobs,
                    advantage=1.0,
                    routes=routes,
                )
            )
        groups.append(TrajectoryGroup(members))
    return groups


def _time(fn, repeats):
    walls, cpus, result = [], [], None
    for _ in range(repeats):
        result = None
        w, c = time.perf_counter(), time.process_time()
        result = fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return statistics.median(walls), statistics.median(cpus), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    config = PackingConfig(seq_len=SEQ_LEN, vocab_size=VOCAB)
    rng = np.random.default_rng(0)
    print(
        f"{'shape':<12} {'path':<26} {'wall s':>8} {'cpu s':>8} {'rows':>5} {'bound':>5} "
        f"{'rows/bound':>10} {'efficiency':>10} {'logical/phys':>12}"
    )
    for name, make in (("single-turn", single_turn), ("multi-turn", multi_turn)):
        with_routes = make(rng, True)
        no_routes = [
            TrajectoryGroup(
                [
                    Trajectory(t.tokens, t.assistant_mask, t.logprobs, t.advantage)
                    for t in g.trajectories
                ]
            )
            for g in with_routes
        ]
        unshared = [TrajectoryGroup([t]) for g in no_routes for t in g.trajectories]
        buffer = pack_groups(with_routes, config).routes  # last step's route tensors
        cases = (
            ("prefix tree + routes", with_routes, None),
            ("  same, reused route buf", with_routes, buffer),
            ("prefix tree, no routes", no_routes, None),
            ("baseline: no sharing", unshared, None),
        )
        results = {}
        for label, groups, reuse in cases:
            wall, cpu, packed = _time(
                lambda groups=groups, reuse=reuse: pack_groups(groups, config, route_buffer=reuse),
                args.repeats,
            )
            s = packed.stats
            results[label] = (wall, s.rows)
            print(
                f"{name:<12} {label:<26} {wall:8.3f} {cpu:8.3f} {s.rows:5d} "
                f"{s.lower_bound_rows:5d} {s.rows / s.lower_bound_rows:10.3f} "
                f"{s.efficiency:10.3f} {s.logical_tokens / s.physical_tokens:12.2f}"
            )
            del packed
        base_rows = results["baseline: no sharing"][1]
        tree_rows = results["prefix tree + routes"][1]
        print(f"{name:<12} rows saved vs no sharing: {base_rows / tree_rows:.2f}x fewer rows")


if __name__ == "__main__":
    main()
