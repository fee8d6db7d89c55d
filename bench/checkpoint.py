"""Checkpoint cost against plain torch baselines of the same state, in the same run.

Three ratios, each goal <= 1.15x:
- stall: how long the training loop is blocked by `AsyncCheckpointer.save` (snapshot into
  host memory, then the write, XXH3-128 digest and commit run in the background) vs a plain
  in-memory copy of the same state (`clone()` of every tensor). Measured with the previous
  background save already committed, as in a loop whose saves are further apart than a save
  takes.
- save: the complete crash-atomic save (`ShardedCheckpointer.save`: write with the digest in
  the same pass, fsync of the shard, manifest, rename, directory fsyncs, removal of the previous
  generation) vs `torch.save` to a file followed by `fsync` of that file.
- load: `ShardedCheckpointer.load` (one pass: `torch.load(mmap=True)`, then each storage
  copied into private memory and hashed from the copy while in cache) vs `torch.load` of the
  plain file.

Diagnostic column: `xxh3` is XXH3-128 alone over the shard's bytes on one core.
Baseline and measured runs are interleaved so background load on a shared host hits both.

Usage: python bench/checkpoint.py [--mib 16 128 1024] [--repeats 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import xxhash

from art_megatron_ext.optim import AsyncCheckpointer, CheckpointConfig, ShardedCheckpointer


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


def plain_copy(state):
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: plain_copy(v) for k, v in state.items()}
    if isinstance(state, list):
        return [plain_copy(v) for v in state]
    return state


def torch_save_fsync(state, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def xxh3_seconds(path: Path, repeats: int) -> tuple[float, float]:
    """(MiB, median seconds of XXH3-128 over the file's bytes in memory)."""
    data = path.read_bytes()
    times = [timed(lambda: xxhash.xxh3_128(data).hexdigest()) for _ in range(repeats)]
    return len(data) / (1 << 20), statistics.median(times)


def run(mib: int, repeats: int, root: Path) -> dict:
    state = optimizer_like_state(mib)
    plain = root / f"plain-{mib}.pt"
    ck = ShardedCheckpointer(CheckpointConfig(root / f"atomic-{mib}"))
    background = AsyncCheckpointer(ShardedCheckpointer(CheckpointConfig(root / f"async-{mib}")))
    step = iter(range(1, 1 << 30))
    t: dict[str, list[float]] = {
        k: [] for k in ("copy", "stall", "plain_save", "atomic_save", "plain_load", "atomic_load")
    }
    for _ in range(repeats):
        t["copy"].append(timed(lambda: plain_copy(state)))
        gc.collect()
        t["stall"].append(timed(lambda: background.save(state, step=next(step), objective="rl")))
        background.wait()  # outside the stall: the commit finished before the next save
        gc.collect()
        t["plain_save"].append(timed(lambda: torch_save_fsync(state, plain)))
        t["atomic_save"].append(timed(lambda: ck.save(state, step=next(step), objective="rl")))
        t["plain_load"].append(timed(lambda: torch.load(plain, weights_only=True)))
        gc.collect()
        t["atomic_load"].append(timed(lambda: ck.load()))
        gc.collect()
    background.close()
    size, digest = xxh3_seconds(plain, repeats)
    return {"mib": size, "xxh3": digest, **{k: statistics.median(v) for k, v in t.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[16, 128, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="default: a temporary directory")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for mib in args.mib:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:  # removed after each size
            rows.append(run(mib, args.repeats, Path(tmp)))
        gc.collect()
    print(f"median ms of {args.repeats}; ratio = ours / plain torch baseline (goal <= 1.15x)")
    print(
        f"{'MiB':>6} | {'copy':>7} {'stall':>7} {'ratio':>6} | {'save+fsync':>10} {'atomic':>7} "
        f"{'ratio':>6} {'xxh3':>6} | {'torch.load':>10} {'atomic':>7} {'ratio':>6}"
    )
    for r in rows:
        print(
            f"{r['mib']:6.1f} | {r['copy'] * 1e3:7.1f} {r['stall'] * 1e3:7.1f} "
            f"{r['stall'] / r['copy']:5.2f}x | {r['plain_save'] * 1e3:10.1f} "
            f"{r['atomic_save'] * 1e3:7.1f} {r['atomic_save'] / r['plain_save']:5.2f}x "
            f"{r['xxh3'] * 1e3:6.1f} | {r['plain_load'] * 1e3:10.1f} "
            f"{r['atomic_load'] * 1e3:7.1f} {r['atomic_load'] / r['plain_load']:5.2f}x"
        )


if __name__ == "__main__":
    main()
