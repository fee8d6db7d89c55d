"""Run a function on N spawned ranks joined in one gloo process group (CPU tests).

Why: multi-rank tests (dispatchers, checkpoints, router replay) need real
`torch.distributed` collectives, but spawning processes and importing torch/Megatron is slow
on the shared 2-core box. So a test module calls `run_ranks` once (for example from a
module-scoped fixture), runs all of its cases inside the worker, returns plain picklable
results, and asserts on them in the parent, one test per behaviour.

Usage::

    def _worker(rank: int, world_size: int, seed: int) -> dict:
        ...                                   # torch.distributed is initialized (gloo)
        return {"case_a": max_abs_diff}

    results = run_ranks(_worker, world_size=2, args=(0,))   # list indexed by rank

The worker must be a module-level function (it is pickled by reference for `spawn`).
A failure on any rank raises `RankError` in the parent carrying that rank's traceback; a
hang raises `RankError` after `timeout_s` and the children are killed.
"""

from __future__ import annotations

import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch.multiprocessing as mp

__all__ = ["RankError", "run_ranks"]


class RankError(RuntimeError):
    """A spawned rank raised, exited abnormally, or did not finish in time."""


def _child(
    rank: int,
    world_size: int,
    init_file: str,
    fn: Callable[..., Any],
    args: Sequence[Any],
    results: Any,
    num_threads: int,
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(num_threads)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # reported to the parent, which raises RankError
        results.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float = 180.0,
    num_threads: int = 1,
    daemon: bool = True,
) -> list[Any]:
    """Spawn `world_size` processes, run `fn(rank, world_size, *args)` in each, return results.

    Args:
        fn: module-level callable; its return value must be picklable.
        world_size: number of ranks (>= 1).
        args: extra positional arguments passed to every rank (picklable).
        timeout_s: wall-clock limit for the whole group.
        num_threads: torch intra-op threads per rank (1 keeps a small box responsive).
        daemon: spawn daemonic ranks (killed with the parent). False for workers that start
            processes themselves (Megatron's dist_checkpointing save starts a
            `multiprocessing.Manager`); they are still joined or killed on return or timeout.

    Returns:
        The per-rank return values, indexed by rank.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="art_dist_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_child,
                args=(rank, world_size, init_file, fn, tuple(args), results, num_threads),
                daemon=daemon,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        return collect(procs, results, world_size, timeout_s)


def collect(procs, results, world_size: int, timeout_s: float) -> list[Any]:
    """Each started rank's result from `results` (rank, ok, value), in rank order: a rank that
    raised or died is a `RankError` at once, past `timeout_s` the missing ranks are named;
    every process is joined (killed if still alive) whatever happens. Shared by the spawned
    ranks here and the forked ones of `support.train_ranks`."""
    out: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while len(out) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(out))
                raise RankError(f"ranks {missing} did not finish within {timeout_s:.0f} s")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if r not in out and not p.is_alive() and p.exitcode not in (0, None)
                ]
                if dead:
                    codes = {r: procs[r].exitcode for r in dead}
                    raise RankError(f"ranks exited abnormally (exit codes {codes})") from None
                continue
            if not ok:
                raise RankError(f"rank {rank} of {world_size} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]
