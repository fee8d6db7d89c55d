"""The full-weight stream of a model that lives on the GPU (marked `gpu` for the cuda case).

A GPU trainer's parameters are CUDA tensors: the first GPU run (2026-12-04) showed the stream
failing at its first tensor (`.numpy()` of a CUDA tensor, for the digest). Here a GPT (bf16,
wrapped in Megatron's `Float16Module` as a bf16 trainer holds it) streams from the device: the
sink gets every tensor on the device (the stream makes no host copy for it), and the names,
bytes and digest equal the stream of the same weights on CPU.

Needs megatron-core (carried to the GPU machine) for the cuda case. CPU twin: the `cpu` case,
the same code and checks with the model on CPU, in CI.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.devices import cpu_and_cuda
from support.gpt_shapes import TINY


def _world(device: str):
    if device == "cuda":
        from support.cuda_world import nccl_world_of_one

        return nccl_world_of_one("art_stream_gpu_")
    from support.megatron_cpu import gloo_world_of_one

    return gloo_world_of_one()


def _stream(model, shape) -> tuple[list, set, object]:
    """([(name, host bytes)], devices the sink saw, receipt)."""
    from art_megatron_ext.weights import stream_hf_weights

    got, devices = [], set()

    def sink(name, tensor):
        devices.add(tensor.device.type)
        got.append((name, tensor.detach().cpu().view(torch.uint8).clone()))

    receipt = stream_hf_weights(model, shape, sink)
    return got, devices, receipt


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_a_model_on_the_device_streams_from_the_device(device):
    from megatron.core.transformer.module import Float16Module

    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt

    shape = GptShape(**TINY)
    with _world(device):
        torch.manual_seed(0)
        model = build_gpt(shape, params_dtype=torch.bfloat16)
        config = dataclasses.replace(model.config, bf16=True)
        on_host = Float16Module(config, model)
        want, _, want_receipt = _stream(on_host, shape)
        on_device = on_host.to(device)
        assert {p.device.type for p in on_device.parameters()} == {device}
        got, devices, receipt = _stream(on_device, shape)
    assert devices == {device}
    assert [n for n, _ in got] == [n for n, _ in want]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, want, strict=True))
    assert receipt == want_receipt
