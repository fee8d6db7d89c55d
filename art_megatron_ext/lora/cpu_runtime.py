"""Run a small Megatron-core GPT on a machine without a GPU (tests, the cross-env check).

Why: megatron-core 0.19 reaches for CUDA in three places that do not matter for a CPU run
with dropout off: the model-parallel RNG tracker (`torch.cuda.get_rng_state`), the rotary
embedding (`.to(torch.cuda.current_device())`) and the default causal mask (pass the mask
explicitly instead). While this context is active those RNG calls use the CPU generator and
`torch.cuda.current_device()` answers "cpu". Never enter it on a GPU machine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .. import compat


@contextlib.contextmanager
def cpu_megatron() -> Iterator[None]:
    """Patch the CUDA-only RNG/device calls for the duration; restore them on exit."""
    mrandom = compat.megatron_rng_module()
    saved = [
        (mrandom, "_get_cuda_rng_state", mrandom._get_cuda_rng_state),
        (mrandom, "_set_cuda_rng_state", mrandom._set_cuda_rng_state),
        (torch.cuda, "current_device", torch.cuda.current_device),
    ]
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    tracker = mrandom.get_cuda_rng_tracker()
    tracker_states = tracker.get_states()
    tracker.set_states({**tracker_states, "model-parallel-rng": torch.get_rng_state()})
    try:
        yield
    finally:
        tracker.set_states(tracker_states)
        for owner, name, value in saved:
            setattr(owner, name, value)


def causal_mask(seq_len: int) -> torch.Tensor:
    """Megatron's boolean attention mask ([1, 1, s, s], True = masked) for causal attention."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]
