"""The test-only CPU shim (`tests/support/megatron_cpu.py`) maps CUDA to CPU and undoes it."""

from __future__ import annotations

import pytest
import torch
from support.megatron_cpu import cpu_shim


def test_cuda_factories_streams_and_moves_map_to_cpu_inside():
    with cpu_shim():
        made = [
            torch.zeros(2, device="cuda"),
            torch.empty(2, device=torch.device("cuda", 0)),
            torch.tensor([1.0], device=torch.cuda.current_device()),
            torch.ones(1).new_empty(3, device="cuda:0"),
            torch.ones(1).to("cuda"),
            torch.ones(1).cuda(),
            torch.empty(2, pin_memory=True),
        ]
        assert all(t.device.type == "cpu" for t in made)
        stream = torch.cuda.Stream(device="cuda")
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.stream(stream):
            event = torch.cuda.Event()
            event.record(stream)
        assert not torch.cuda.is_available()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_everything_is_restored_on_exit():
    before = (torch.zeros, torch.Tensor.to, torch.cuda.Stream, torch.distributed.all_to_all_single)
    with cpu_shim():
        assert torch.zeros is not before[0]
    after = (torch.zeros, torch.Tensor.to, torch.cuda.Stream, torch.distributed.all_to_all_single)
    assert after == before
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")
