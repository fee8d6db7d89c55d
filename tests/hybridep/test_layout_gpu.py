"""GPU twin of test_layout's meta check: the static-budget reference pipeline runs on CUDA
under `torch.cuda.set_sync_debug_mode("error")`, so any host synchronization raises.

A separate file from test_layout.py because that one needs hypothesis, which the GPU image
lacks (bench/gpu_check.sh runs this file there)."""

from __future__ import annotations

import pytest
import torch
from support.hybridep_static import static_inputs, static_pipeline

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (meta twin on CPU)"),
]


def test_static_budget_path_does_not_synchronize_on_gpu():
    inputs = static_inputs("cuda")  # the copies to the GPU happen before the mode is on
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = static_pipeline(inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.device.type == "cuda" and tuple(out.shape) == (5, 4)
