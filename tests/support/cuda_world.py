"""A one-process NCCL world with Megatron's parallel state, for the GPU-marked Megatron tests.

Not collected by pytest. Why one helper: every GPU twin needs the same set-up (a process group,
TP=1 parallel state, the CUDA RNG tracker seeded) and the same tear-down.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def nccl_world_of_one(prefix: str) -> Iterator[None]:
    """NCCL world of 1 (unless one exists), Megatron TP=1 parallel state, CUDA RNG seeded 0."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    created = not torch.distributed.is_initialized()
    if created:
        rdzv = os.path.join(tempfile.mkdtemp(prefix=prefix), "rdzv")
        torch.distributed.init_process_group(
            "nccl", init_method=f"file://{rdzv}", rank=0, world_size=1
        )
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if created:
            torch.distributed.destroy_process_group()
