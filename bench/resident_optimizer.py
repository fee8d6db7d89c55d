"""Resident optimizer state: reusing it across jobs vs rebuilding and loading it from disk.

Baseline (same run): a job whose key differs from the resident one, so the store builds a
fresh optimizer and loads trainable tensors and Adam moments from the checkpoint at its
optimizer path (digest-verified). Measured: a job with the same key (resident reuse), and a
fresh rebuild with no checkpoint (no disk read) for reference. Every acquire is followed by one
optimizer step so lazily created state is included.

Usage: python bench/resident_optimizer.py [--sites 64] [--dim 2048] [--rank 16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from art_megatron_ext.optim import ResidentKey, ResidentOptimizerStore


class LoRASites(nn.Module):
    """`sites` LoRA pairs (A: rank x dim, B: dim x rank): the trainable state of an adapter."""

    def __init__(self, sites: int, dim: int, rank: int) -> None:
        super().__init__()
        self.a = nn.ParameterList(nn.Parameter(torch.randn(rank, dim) * 0.01) for _ in range(sites))
        self.b = nn.ParameterList(nn.Parameter(torch.zeros(dim, rank)) for _ in range(sites))

    def loss(self) -> torch.Tensor:
        return sum((b @ a).square().mean() for a, b in zip(self.a, self.b, strict=True))


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def one_step(state) -> None:
    for p in state.optimizer.param_groups[0]["params"]:
        p.grad = torch.full_like(p, 1e-3)
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)


def timed_acquire(store, key, model) -> tuple[float, float, str]:
    """(acquire seconds, acquire + first optimizer step seconds, residency)."""
    start = time.perf_counter()
    state = store.acquire(key, model, adamw)
    acquired = time.perf_counter()
    one_step(state)
    return acquired - start, time.perf_counter() - start, state.residency.value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=int, default=64)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = LoRASites(args.sites, args.dim, args.rank)
    numel = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(tmp) / "rl-a", Path(tmp) / "rl-b"]
        store = ResidentOptimizerStore()
        for path in paths:  # a committed checkpoint at both paths
            state = store.acquire(ResidentKey("s", "rl", path), model, adamw)
            one_step(state)
            state.save(1)
        times: dict[str, list[tuple[float, float]]] = {
            "rebuild+load": [],
            "reuse": [],
            "rebuild fresh": [],
        }
        for i in range(args.repeats):
            key = ResidentKey("s", "rl", paths[i % 2])  # alternate: the key always changes
            fresh = ResidentKey("s", "sft", Path(tmp) / f"none-{i}")
            for name, job_key, expected in (
                ("rebuild+load", key, "loaded"),
                ("reuse", key, "reused"),
                ("rebuild fresh", fresh, "rebuilt"),
            ):
                acquire_s, with_step_s, how = timed_acquire(store, job_key, model)
                assert how == expected, (name, how)
                times[name].append((acquire_s, with_step_s))
    base = [statistics.median(v[k] for v in times["rebuild+load"]) for k in (0, 1)]
    print(
        f"trainable params {numel / 1e6:.1f} M ({numel * 12 / 2**20:.0f} MiB with Adam moments), "
        f"{args.repeats} repeats, median; ratio vs rebuild+load"
    )
    print(f"{'job start':>14} | {'acquire ms':>10} {'ratio':>8} | {'+1 step ms':>10} {'ratio':>7}")
    for name, values in times.items():
        acquire = statistics.median(v[0] for v in values)
        with_step = statistics.median(v[1] for v in values)
        print(
            f"{name:>14} | {acquire * 1e3:10.3f} {acquire / base[0]:7.4f}x | "
            f"{with_step * 1e3:10.2f} {with_step / base[1]:6.3f}x"
        )


if __name__ == "__main__":
    main()
