"""`run_ranks` for the training-side CPU tests: ranks forked from a server that has already
imported torch and Megatron-core, instead of each rank a fresh interpreter importing them.

Why: a spawned rank spends 5-9 CPU-seconds importing torch and megatron-core before it runs
a test's work, often under a second, and the train lane starts dozens of ranks. Forked,
the lane took 490 CPU-seconds instead of 920 (2-core box, 2026-12-07). Python's `forkserver`
start method keeps one server process per test session that imports `PRELOAD` once; each
rank is a `fork()` of it (copy-on-write, milliseconds), then runs exactly what a spawned rank
runs (`support.dist._child`: its own gloo group, the function, the result or traceback).

What a forked rank shares with a spawned one, and what is made so:
- modules: the preloaded ones are imported as a spawned rank would import them (their
  import-time state, never a test's: the server runs no test code); everything else, the
  test module and its function included, is imported in the rank after the fork, as with
  spawn. sys.path and the working directory come from the parent at each launch
  (multiprocessing's preparation data), like spawn.
- the environment: the server was started with the parent's environment of its first use,
  so each rank takes the parent's `os.environ` of the moment it is launched (a test's
  `monkeypatch.setenv` reaches the ranks, as it does with spawn).
- random state: Python's `random` is reseeded by the fork itself; numpy's global generator
  is reseeded from the OS (a spawned rank seeds it from the OS at import); torch's default
  generator has its import-time default seed in both.
- failures: a rank that raises, dies or hangs is reported as `support.dist.run_ranks` reports
  it (its `collect` loop, the same `RankError`; tests/train_env/test_train_ranks.py).

On a host with a CUDA GPU (the GPU check's runs) the ranks are spawned as before
(`support.dist.run_ranks`): a rank that uses CUDA must not be forked from a process whose
imports may have touched the driver, and the import time does not matter there.

`support.dist.run_ranks` stays the spawn runner that bench/gpu_check_hybridep.py and the
serving side use (tests/train_env/test_gpu_check.py checks it as such).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.multiprocessing as mp

from support import dist

__all__ = ["PRELOAD", "RankError", "run_ranks"]

RankError = dist.RankError

PRELOAD = (
    "torch",
    "torch.distributed",
    "numpy",
    "safetensors.torch",
    "megatron.core.parallel_state",
    "megatron.core.models.gpt",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.dist_checkpointing",
    "art_megatron_ext.lora",
    "art_megatron_ext.moe",
    "art_megatron_ext.optim",
    "art_megatron_ext.packing",
    "art_megatron_ext.routing",
    "art_megatron_ext.weights",
    "hybridep.backends",
)
"""Imported once by the fork server (a name that fails to import is skipped, by Python)."""

_context = None


def _forkserver_context():
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(list(PRELOAD))
        atexit.register(_stop_server)
    return _context


def _stop_server() -> None:
    """Stop and reap the fork server at exit, so its CPU time and its ranks' count to this
    process's children, as the spawned ranks' did (a process's reaped children count to its
    parent once it is reaped itself). Its ranks were all joined by then; it is terminated,
    not asked to exit: an interpreter holding torch and Megatron takes seconds to finalize."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    pid, alive = server._forkserver_pid, server._forkserver_alive_fd
    if pid is None:
        return
    server._forkserver_pid = server._forkserver_alive_fd = None
    os.close(alive)
    os.kill(pid, signal.SIGTERM)
    os.waitpid(pid, 0)


class _StdStreams:
    """The parent's stdout and stderr, sent to the rank by file descriptor: a rank writes
    where a spawned one would (under pytest, the capture of the running test), not where the
    fork server's streams pointed when it started."""

    def __reduce__(self):
        from multiprocessing import reduction

        return (_adopt_std_streams, (reduction.DupFd(1), reduction.DupFd(2)))


def _adopt_std_streams(out, err) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    for wrapped, target in ((out, 1), (err, 2)):
        fd = wrapped.detach()
        os.dup2(fd, target)
        os.close(fd)


def _forked_child(streams: None, env: dict[str, str], *child_args: Any) -> None:
    """Unpickling `streams` already redirected fds 1 and 2 (`_StdStreams`)."""
    os.environ.clear()
    os.environ.update(env)
    import numpy

    numpy.random.seed()  # the server's state otherwise, the same in every rank
    dist._child(*child_args)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float = 180.0,
    num_threads: int = 1,
    daemon: bool = True,
) -> list[Any]:
    """`support.dist.run_ranks` with ranks forked from the preloaded server (see the module
    docstring): the same arguments, results and errors.

    Args:
        fn: module-level callable; its return value must be picklable.
        world_size: number of ranks (>= 1).
        args: extra positional arguments passed to every rank (picklable).
        timeout_s: wall-clock limit for the whole group.
        num_threads: torch intra-op threads per rank.
        daemon: daemonic ranks; False for workers that start processes themselves.

    Returns:
        The per-rank return values, indexed by rank.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if torch.cuda.is_available():  # see the module docstring: spawned on a GPU host
        kwargs = dict(timeout_s=timeout_s, num_threads=num_threads, daemon=daemon)
        return dist.run_ranks(fn, world_size, args, **kwargs)
    ctx = _forkserver_context()
    results = ctx.Queue()
    env, args, threads = dict(os.environ), tuple(args), num_threads
    with tempfile.TemporaryDirectory(prefix="art_dist_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_forked_child,
                args=(_StdStreams(), env, rank, world_size, init_file, fn, args, results, threads),
                daemon=daemon,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        return dist.collect(procs, results, world_size, timeout_s)
