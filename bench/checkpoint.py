"""Crash-atomic sharded checkpoint save/load vs plain torch.save/torch.load of the same state.

Baseline (same run, same directory): `torch.save(state, path)` and `torch.load(path)`, which
neither fsync, digest nor commit anything. The atomic path adds: BLAKE2b-256 of every byte,
fsync of the shard, the manifest and the directory, a rename per file and removal of the
previous generation; its load adds a digest verification of every byte. The goal is
<= 1.15x. Two diagnostic columns attribute the difference: `no fsync` is the atomic save
with its fsyncs skipped (not a supported mode: it shows the cost of durability on this
disk), `digest` is BLAKE2b-256 alone over the shard's bytes on one core.

Usage: python bench/checkpoint.py [--mib 16 128] [--repeats 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
from pathlib import Path

import torch

from art_megatron_ext.optim import CheckpointConfig, CheckpointIO, ShardedCheckpointer


class NoFsyncIO(CheckpointIO):
    """Diagnostic only: the same save without fsync, to attribute the save's cost."""

    def fsync(self, f) -> None:
        f.flush()

    def fsync_dir(self, directory) -> None:
        pass


def optimizer_like_state(mib: int) -> dict:
    """fp32 params plus two Adam moments, split over several tensors like a LoRA shard."""
    numel = mib * (1 << 20) // 4 // 3
    pieces = 8
    g = torch.Generator().manual_seed(0)
    return {
        "trainable": {f"p{i}": torch.randn(numel // pieces, generator=g) for i in range(pieces)},
        "optimizer": {
            "state": {
                i: {
                    "step": torch.tensor(7.0),
                    "exp_avg": torch.randn(numel // pieces, generator=g),
                    "exp_avg_sq": torch.rand(numel // pieces, generator=g),
                }
                for i in range(pieces)
            },
            "param_groups": [{"lr": 1e-4, "params": list(range(pieces))}],
        },
    }


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(mib: int, repeats: int, root: Path) -> dict:
    state = optimizer_like_state(mib)
    plain = root / f"plain-{mib}.pt"
    ck = ShardedCheckpointer(CheckpointConfig(root / f"atomic-{mib}"))
    no_fsync = ShardedCheckpointer(CheckpointConfig(root / f"nofsync-{mib}"), io=NoFsyncIO())
    step = iter(range(1, 1 << 30))

    # Interleave baseline and atomic runs so background load hits both alike.
    plain_save, atomic_save, nosync_save, plain_load, atomic_load = [], [], [], [], []
    for _ in range(repeats):
        plain_save.append(timed(lambda: torch.save(state, plain), 1))
        atomic_save.append(timed(lambda: ck.save(state, step=next(step), objective="rl"), 1))
        nosync_save.append(timed(lambda: no_fsync.save(state, step=next(step), objective="rl"), 1))
        plain_load.append(timed(lambda: torch.load(plain, weights_only=True), 1))
        atomic_load.append(timed(lambda: ck.load(), 1))
    data = plain.read_bytes()
    digest = timed(lambda: hashlib.blake2b(data, digest_size=32).digest(), repeats)
    return {
        "mib": plain.stat().st_size / (1 << 20),
        "plain_save": statistics.median(plain_save),
        "atomic_save": statistics.median(atomic_save),
        "nosync_save": statistics.median(nosync_save),
        "plain_load": statistics.median(plain_load),
        "atomic_load": statistics.median(atomic_load),
        "digest": digest,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="default: a temporary directory")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rows = [run(mib, args.repeats, Path(tmp)) for mib in args.mib]
    print("median ms; ratio = atomic / plain torch (goal <= 1.15x)")
    print(
        f"{'MiB':>6} | {'torch.save':>10} {'atomic':>8} {'ratio':>6} | {'no fsync':>8} "
        f"{'digest':>7} | {'torch.load':>10} {'atomic':>8} {'ratio':>6}"
    )
    for r in rows:
        print(
            f"{r['mib']:6.1f} | {r['plain_save'] * 1e3:10.1f} {r['atomic_save'] * 1e3:8.1f} "
            f"{r['atomic_save'] / r['plain_save']:5.2f}x | {r['nosync_save'] * 1e3:8.1f} "
            f"{r['digest'] * 1e3:7.1f} | {r['plain_load'] * 1e3:10.1f} "
            f"{r['atomic_load'] * 1e3:8.1f} {r['atomic_load'] / r['plain_load']:5.2f}x"
        )


if __name__ == "__main__":
    main()
