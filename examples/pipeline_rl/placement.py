"""Where a trainer rank runs: one typed choice of device, and everything that follows from it.

`LoopConfig.device` says "auto" (CUDA when this process sees a GPU, else CPU), "cuda" or
"cpu"; `choose` turns it into a `Placement` once per rank, and the rest of the trainer reads
that object instead of asking torch again:

- the collective backend: NCCL on CUDA, gloo on CPU (`init_ranks`);
- the rank's device: on CUDA the GPU of its LOCAL_RANK (what torchrun hands out), set as the
  current device before the process group starts (NCCL and the object collectives use it);
- Megatron's runtime (`megatron_runtime`): on CUDA the model-parallel RNG tracker seeded
  (`model_parallel_cuda_manual_seed`), as Megatron trainers do; on CPU the stand-ins for
  Megatron's CUDA-only calls (`art_megatron_ext.cpu_stand_in`, `lora.cpu_runtime`), which
  are entered only there (they refuse a GPU);
- where tensors live: the model, its DDP buffers, the packed batch, the temperature grid,
  the token weight `finalize_model_grads` all-reduces and the step's loss sums are all on
  `Placement.device` (NCCL takes device tensors only). Host copies are made where the
  trainer moves data itself (`.cpu()` before `.numpy()`, the export's host copies).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from loop_config import DEVICES


@dataclass(frozen=True)
class Placement:
    """A rank's device; the backend and the runtime follow from its type."""

    device: torch.device

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def backend(self) -> str:
        """NCCL between GPUs, gloo between CPU processes."""
        return "nccl" if self.on_cuda else "gloo"


def choose(requested: str, *, local_rank: int = 0, cuda_devices: int | None = None) -> Placement:
    """The placement of the rank with `local_rank` on its host. `cuda_devices`: the GPUs this
    process sees (default `torch.cuda.device_count()`; a parameter so tests can ask what a GPU
    host would get). Raises ValueError naming the setting that cannot be honoured."""
    if requested not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {requested!r}")
    gpus = torch.cuda.device_count() if cuda_devices is None else cuda_devices
    if requested == "cpu" and gpus > 0:
        raise ValueError(
            f"device 'cpu' on a host where this process sees {gpus} GPU(s): Megatron's CPU "
            "stand-ins refuse to run beside CUDA; hide the GPUs (CUDA_VISIBLE_DEVICES=, as "
            "run.py does for --device cpu) to train on the CPU, or use device 'auto'"
        )
    if gpus == 0 and requested in ("auto", "cpu"):
        return Placement(torch.device("cpu"))
    if gpus == 0:
        raise ValueError("device 'cuda' was asked for, but this process sees no CUDA GPU")
    if not 0 <= local_rank < gpus:
        raise ValueError(
            f"LOCAL_RANK {local_rank} has no GPU of its own: this process sees {gpus} "
            f"(start at most {gpus} rank(s) per host, e.g. --dp {gpus}, or --device cpu)"
        )
    return Placement(torch.device("cuda", local_rank))


def local_rank() -> int:
    """LOCAL_RANK as torchrun (and run.py) set it; 0 for a single rank started by hand."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def init_ranks(placement: Placement, tmp: str) -> tuple[int, int]:
    """(rank, world): from torchrun's variables when they are set, else a single rank (a
    file rendezvous in `tmp`). On CUDA the rank's GPU is made current first."""
    if placement.on_cuda:
        torch.cuda.set_device(placement.device)
    if "WORLD_SIZE" in os.environ:
        torch.distributed.init_process_group(placement.backend)
    else:
        torch.distributed.init_process_group(
            placement.backend, init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1
        )
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


@contextlib.contextmanager
def megatron_runtime(placement: Placement, seed: int) -> Iterator[None]:
    """Around everything that builds or runs the Megatron model; after Megatron's parallel
    state is initialized. CUDA: the RNG tracker seeded. CPU: the stand-ins, restored on exit
    (they patch torch process-wide while active)."""
    if placement.on_cuda:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
        yield
        return
    from art_megatron_ext.cpu_stand_in import cpu_shim, cuda_tensor_type_names
    from art_megatron_ext.lora.cpu_runtime import cpu_megatron

    with cpu_shim(), cuda_tensor_type_names(), cpu_megatron():
        yield
