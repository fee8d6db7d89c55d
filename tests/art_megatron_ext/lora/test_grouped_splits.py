"""A grouped LoRA site turns Megatron's host `m_splits` into a tensor once per forward.

Why: the grouped GEMM op converts a list of token counts into a device tensor on every call
(a host-to-device copy that waits for the stream), and a grouped site runs two LoRA GEMMs per
forward. The base stand-in (`support.fake_grouped`) loops per expert and converts nothing,
so every list conversion counted during a forward is the LoRA path's.
"""

from __future__ import annotations

import pytest
import torch
from support.decoder_layer import with_experts
from support.fake_grouped import FakeColumnParallelGroupedLinear

from art_megatron_ext.lora import LoraConfig, attach_lora, iter_lora_sites
from art_megatron_ext.lora.padding import logical_view

HIDDEN, OUT, EXPERTS = 16, 24, 4
SPLITS = [3, 0, 5, 2]


def _linear() -> torch.nn.Module:
    torch.manual_seed(0)
    experts = torch.nn.Module()
    experts.num_local_experts = EXPERTS
    experts.linear_fc1 = FakeColumnParallelGroupedLinear(EXPERTS, HIDDEN, OUT, gated=False)
    model = with_experts(experts)
    attach_lora(model, LoraConfig(rank=4, alpha=8.0, targets=("linear_fc1",)))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for entry in iter_lora_sites(model):
            view = logical_view(entry.adapter.b)
            view.copy_(torch.randn(view.shape, generator=g))
    return experts.linear_fc1


@pytest.fixture()
def list_conversions(monkeypatch):
    """Counts `torch.tensor` / `torch.as_tensor` calls made from a Python list or tuple."""
    calls = []
    for name in ("tensor", "as_tensor"):
        original = getattr(torch, name)

        def counting(data, *args, _original=original, **kwargs):
            if isinstance(data, (list, tuple)):
                calls.append(list(data))
            return _original(data, *args, **kwargs)

        monkeypatch.setattr(torch, name, counting)
    return calls


def _delta_ref(linear, x) -> torch.Tensor:
    adapter = linear.lora.slots["default"]
    a, b = logical_view(adapter.a), logical_view(adapter.b)
    outs = [(xe @ a[e].T @ b[e].T) * adapter.scaling for e, xe in enumerate(torch.split(x, SPLITS))]
    return torch.cat(outs)


def test_one_host_to_device_conversion_per_forward(list_conversions):
    linear = _linear()
    x = torch.randn(sum(SPLITS), HIDDEN, requires_grad=True)
    out, _ = linear(x, SPLITS)
    assert list_conversions == [SPLITS]  # was two: one per LoRA GEMM
    out.square().sum().backward()
    assert list_conversions == [SPLITS]  # backward reuses the forward's group ends
    base, _ = FakeColumnParallelGroupedLinear.forward(linear, x.detach(), SPLITS)
    expected = base + _delta_ref(linear, x.detach())
    torch.testing.assert_close(out.detach(), expected, rtol=1e-5, atol=1e-5)


def test_tensor_splits_need_no_conversion(list_conversions):
    linear = _linear()
    x = torch.randn(sum(SPLITS), HIDDEN)
    splits = torch.tensor(SPLITS)
    with_list, _ = linear(x, SPLITS)
    list_conversions.clear()
    with_tensor, _ = linear(x, splits)
    assert list_conversions == []
    assert torch.equal(with_list, with_tensor)


@pytest.mark.parametrize("bad", [[3, 0, 5], [3, 0, 6, 2], [4, -1, 5, 2]])
def test_bad_host_splits_are_refused_naming_them(bad):
    linear = _linear()
    x = torch.randn(sum(SPLITS), HIDDEN)
    with pytest.raises(ValueError, match=r"m_splits \[.*\] must hold 4 non-negative"):
        linear.lora.delta(x, linear.lora.slots["default"], bad)
