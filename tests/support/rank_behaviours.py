"""Rank functions for the CPU tests of `support.dist.run_ranks`, which the GPU check's
multi-process stage runs its ranks with (importable by the spawned children, which a test
module's own functions are not reliably)."""

from __future__ import annotations

import os
import time


def answer(rank: int, world: int, cfg: dict) -> dict:
    return {"rank": rank, "world": world}


def rank_one_dies(rank: int, world: int, cfg: dict) -> dict:
    if rank == 1:
        os._exit(3)  # no result, no exception: what a CUDA fault or the OOM killer leaves
    time.sleep(cfg.get("survivor_sleep_s", 0))
    return {"rank": rank}


def rank_one_hangs(rank: int, world: int, cfg: dict) -> dict:
    # Both ranks through a barrier first: otherwise rank 0 could return and close the gloo
    # group while rank 1 is still connecting its mesh, and rank 1 fails ("Connection closed
    # by peer", seen in a clean-clone run) instead of hanging.
    import torch.distributed as dist

    dist.barrier()
    if rank == 1:
        time.sleep(3600)
    return {"rank": rank}


def rank_zero_raises(rank: int, world: int, cfg: dict) -> dict:
    if rank == 0:
        raise ValueError("rank zero's input is bad")
    time.sleep(3600)  # a peer that would wait for rank 0 in a collective
    return {"rank": rank}
