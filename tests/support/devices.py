"""The device parameter of a test that runs on CPU in CI and on the GPU in the GPU check.

Not collected by pytest. `cpu` is the CPU twin (skipped on a GPU host: Megatron's CPU
stand-ins refuse to run beside CUDA, and the cuda case runs there instead); `cuda` is marked
`gpu` (bench/gpu_check.sh selects it) and skips, with the reason, where there is no GPU or no
megatron-core.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None


def cpu_and_cuda() -> list:
    """`pytest.mark.parametrize("device", cpu_and_cuda())`."""
    return [
        pytest.param(
            "cpu",
            marks=pytest.mark.skipif(
                torch.cuda.is_available(),
                reason="the CPU stand-ins refuse a GPU host; the cuda case runs here instead",
            ),
        ),
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(
                    not (torch.cuda.is_available() and HAVE_MEGATRON),
                    reason="needs a CUDA GPU and megatron-core (on the GPU machine from the "
                    "carry, bench/gpu_check.sh); the cpu case is its twin",
                ),
            ],
        ),
    ]
