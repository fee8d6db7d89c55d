"""Benchmark: server output -> packed tensors + route tensor, end to end, CPU time by stage.

Why: issue 15 item 5 asks for groups of rollouts turned into the trainer's packed tensors and
route tensor in < 0.1 s of CPU for the single-turn shape of `bench/packing.py` (64 groups x 8
rollouts, 1k-token prompt, 1-4k-token completions, 32k rows, 48 layers x top-8, 128 experts),
starting from what the server sends: per group (one request with n = 8) a route bundle
(`bytes`, `application/vnd.art.routes` carries it as is) holding the 8 choices' routes over
prompt + completion, and the token ids.

Stages, each timed alone (CPU = user + sys from getrusage, so page faults count), median of
--repeats:
  decode      `decode_route_bundle` per group: header checks and the expert-id range check
              (one pass over every received byte; the format requires it), views, no copy;
  pack        `pack_groups` without routes (prefix trees, placement, token tensors);
  routes      `pack_groups` with routes minus `pack`: route collation into a fresh tensor
              (`torch.empty`, first-touch page faults) or into the previous step's tensor;
  floor       one copy of the bytes the route tensor holds into a reused buffer (memory
              bandwidth: what any collation must pay at least), and the same copy into a
              fresh buffer from `torch.empty` (4 KiB pages) and from `numpy.empty` (numpy asks
              for transparent huge pages, which `collate_routes` now allocates with).
End to end = decode + pack_groups with routes (fresh, or reused buffer).
Also printed: user and sys CPU of the fresh collation and its page-fault count.

Run: .venv-train/bin/python bench/route_pipeline.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from packing import EXPERTS, SEQ_LEN, VOCAB, single_turn

from art_megatron_ext.packing import (
    PackingConfig,
    Trajectory,
    TrajectoryGroup,
    pack_groups,
)
from art_megatron_ext.routing import decode_route_bundle, encode_route_bundle


def _usage() -> tuple[float, float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_minflt


def _measure(fn, repeats: int) -> tuple[float, float, float, int, object]:
    """Median CPU (user + sys), median user, median sys, median minor faults, last result."""
    cpu, user, system, faults, result = [], [], [], [], None
    for _ in range(repeats):
        result = None
        u0, s0, f0 = _usage()
        result = fn()
        u1, s1, f1 = _usage()
        cpu.append(u1 - u0 + s1 - s0)
        user.append(u1 - u0)
        system.append(s1 - s0)
        faults.append(f1 - f0)
    med = statistics.median
    return med(cpu), med(user), med(system), int(med(faults)), result


def server_output(groups: list[TrajectoryGroup]) -> list[tuple[bytes, list[Trajectory]]]:
    """Per group: the bundle the server sends (bytes) and the trajectories without routes."""
    out = []
    for group in groups:
        bundle = bytes(encode_route_bundle([t.routes for t in group.trajectories], num_experts=128))
        bare = [
            Trajectory(t.tokens, t.assistant_mask, t.logprobs, t.advantage)
            for t in group.trajectories
        ]
        out.append((bundle, bare))
    return out


def decode(received) -> list[TrajectoryGroup]:
    groups = []
    for bundle, bare in received:
        routes = decode_route_bundle(bundle).routes
        groups.append(
            TrajectoryGroup(
                [
                    Trajectory(t.tokens, t.assistant_mask, t.logprobs, t.advantage, routes=r)
                    for t, r in zip(bare, routes, strict=True)
                ]
            )
        )
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    assert EXPERTS == 128
    config = PackingConfig(seq_len=SEQ_LEN, vocab_size=VOCAB)
    received = server_output(single_turn(np.random.default_rng(0), True))
    wire = sum(len(b) for b, _ in received)
    groups = decode(received)
    no_routes = [TrajectoryGroup(bare) for _, bare in received]
    previous = pack_groups(groups, config).routes  # the last step's route tensors
    placed = previous.routes.numel()
    src = np.random.default_rng(1).integers(0, EXPERTS, placed, dtype=np.uint8)  # real pages
    dst = np.empty(placed, dtype=np.uint8)
    dst[:] = 1

    r = args.repeats
    t_decode = _measure(lambda: decode(received), r)
    t_pack = _measure(lambda: pack_groups(no_routes, config), r)
    t_fresh = _measure(lambda: pack_groups(groups, config), r)
    t_reuse = _measure(lambda: pack_groups(groups, config, route_buffer=previous), r)
    t_floor = _measure(lambda: np.copyto(dst, src), r)

    def fresh_copy(alloc):
        out = alloc()
        np.copyto(out, src)
        return out

    t_alloc_torch = _measure(
        lambda: fresh_copy(lambda: torch.empty(placed, dtype=torch.uint8).numpy()), r
    )
    t_alloc_numpy = _measure(lambda: fresh_copy(lambda: np.empty(placed, dtype=np.uint8)), r)
    e2e_fresh = _measure(lambda: pack_groups(decode(received), config), r)
    e2e_reuse = _measure(lambda: pack_groups(decode(received), config, route_buffer=previous), r)

    print(
        f"single-turn: {sum(len(g.trajectories) for g in groups)} rollouts, bundles "
        f"{wire / 2**20:.0f} MiB received, route tensor {placed / 2**20:.0f} MiB "
        f"({previous.routes.shape[0]} rows)"
    )
    print(f"{'stage':<34} {'cpu s':>7} {'user s':>7} {'sys s':>7} {'faults':>8}")
    rows = (
        ("decode (checks + views)", t_decode),
        ("pack, no routes", t_pack),
        ("pack + routes, fresh tensor", t_fresh),
        ("pack + routes, reused tensor", t_reuse),
        ("floor: one copy of the route bytes", t_floor),
        ("  + fresh buffer: torch.empty", t_alloc_torch),
        ("  + fresh buffer: numpy.empty (THP)", t_alloc_numpy),
        ("END TO END fresh", e2e_fresh),
        ("END TO END reused", e2e_reuse),
    )
    for label, (cpu, user, system, faults, _) in rows:
        print(f"{label:<34} {cpu:7.3f} {user:7.3f} {system:7.3f} {faults:8d}")
    print(
        f"route collation alone: fresh {t_fresh[0] - t_pack[0]:.3f} s, reused "
        f"{t_reuse[0] - t_pack[0]:.3f} s, floor {t_floor[0]:.3f} s"
    )


if __name__ == "__main__":
    main()
