"""W rank processes for the multi-process checks of bench/gpu_check.sh (gloo group).

Why a deadline and a liveness check: the check has one short try on a lent GPU. A rank that
dies (a CUDA fault, the OOM killer) never puts its result, and a rank stuck in a collective
never returns; waiting on the queue forever would cost every later stage its time. So
`run_ranks` polls: a rank that exited without a result fails the call at once naming it and
its exit code, and past `timeout_s` every rank still running is killed and named.
"""

from __future__ import annotations

import os
import queue as queue_module
import tempfile
import time
import traceback

import torch.multiprocessing as mp


class RanksFailed(RuntimeError):
    """A rank raised, died or ran past the deadline; the message names it."""


def _child(rank, world, init_file, fn, cfg, results) -> None:
    try:
        import torch
        import torch.distributed as dist

        if not cfg.get("dry", False):
            torch.cuda.set_device(0)  # every rank on the one GPU
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
        )
        try:
            results.put((rank, True, fn(rank, world, cfg)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn, world: int, cfg: dict, timeout_s: float = 60.0) -> list:
    """`fn(rank, world, cfg)` in `world` spawned processes; their results in rank order.

    Raises RanksFailed naming the first rank that raised (with its traceback; its peers are
    killed, they may be waiting for it in a collective), died (with its exit code) or was
    still running at `timeout_s`. No process outlives the call."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    got: dict[int, tuple[bool, object]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            ctx.Process(target=_child, args=(r, world, init_file, fn, cfg, results), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        try:
            while len(got) < world:
                try:
                    rank, ok, value = results.get(timeout=0.5)
                except queue_module.Empty:
                    pass
                else:
                    if not ok:  # its peers may now wait in a collective forever: stop here
                        raise RanksFailed(f"rank {rank} raised:\n{value}")
                    got[rank] = (ok, value)
                    continue
                dead = [r for r, p in enumerate(procs) if r not in got and not p.is_alive()]
                if dead:
                    time.sleep(0.5)  # a result put just before exiting may still be in flight
                    while True:
                        try:
                            rank, ok, value = results.get_nowait()
                        except queue_module.Empty:
                            break
                        got[rank] = (ok, value)
                    dead = [r for r in dead if r not in got]
                    if dead:
                        codes = {r: procs[r].exitcode for r in dead}
                        raise RanksFailed(
                            f"rank(s) {dead} died without a result (exit codes {codes})"
                        )
                if time.monotonic() > deadline:
                    late = [r for r in range(world) if r not in got]
                    raise RanksFailed(f"rank(s) {late} still running after {timeout_s:.0f} s")
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
    failed = [(r, value) for r, (ok, value) in sorted(got.items()) if not ok]
    if failed:  # a failure drained after a death
        rank, trace = failed[0]
        raise RanksFailed(f"rank {rank} raised:\n{trace}")
    return [got[r][1] for r in range(world)]
