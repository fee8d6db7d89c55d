"""Grouped LoRA (one A/B pair per expert) on the CUTLASS grouped GEMM, on sm_90 (marked `gpu`).

The expert linears of an MoE layer (`ArtGroupedLinear`, column FC1 gated and row FC2) with
LoRA attached and `grouped_gemm_backend="cutlass"`: the base GEMM and both LoRA GEMMs of each
site run through the CUTLASS kernel (an explicit backend never falls back). Forward output,
input gradient and the A and B gradients of every expert, bf16, are compared with a float64
per-expert loop of the same math (x_e W_e + s (x_e A_e^T) B_e^T); uneven token counts with an
empty expert, `m_splits` on the device as a dispatcher hands it.

Needs megatron-core (carried to the GPU machine, `bench/gpu_check_unpack.py`) for the config
and the site's tensor-parallel helpers; no Transformer Engine. CPU twin: the same check in
this file on CPU with `backend="torch"` (the harness), tests/art_megatron_ext/lora/
test_grouped.py (grouped LoRA semantics) and ops/test_grouped_gemm_cutlass.py (the kernel).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from support.decoder_layer import with_experts

HIDDEN, FFN, EXPERTS, RANK = 64, 96, 4, 8
SPLITS = [20, 0, 28, 16]
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
_HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None


@pytest.fixture(scope="module")
def cuda_world():
    from support.cuda_world import nccl_world_of_one

    with nccl_world_of_one("art_grouped_lora_"):
        yield


def _experts(device: str, backend: str):
    """`decoder.layers[0].mlp.experts.linear_fc{1,2}` (bf16, LoRA with non-zero B)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from art_megatron_ext.lora import LoraConfig, attach_lora, iter_lora_sites
    from art_megatron_ext.lora.padding import logical_view
    from art_megatron_ext.moe.grouped_linear import ArtGroupedLinear

    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=4,
        gated_linear_unit=True, add_bias_linear=False, use_cpu_initialization=True,
        params_dtype=torch.bfloat16, gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
    )  # fmt: skip
    torch.manual_seed(0)
    experts = torch.nn.Module()
    experts.num_local_experts = EXPERTS
    experts.linear_fc1 = ArtGroupedLinear(
        EXPERTS, HIDDEN, 2 * FFN, kind="column", config=config, backend=backend
    )
    experts.linear_fc2 = ArtGroupedLinear(
        EXPERTS, FFN, HIDDEN, kind="row", config=config, backend=backend
    )
    for linear in (experts.linear_fc1, experts.linear_fc2):
        linear.init_like_megatron(config.init_method)
    model = with_experts(experts)
    model = model.to(device)
    attach_lora(model, LoraConfig(rank=RANK, alpha=16.0, targets=("linear_fc1", "linear_fc2")))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for e in iter_lora_sites(model):
            view = logical_view(e.adapter.b)
            view.copy_(torch.randn(view.shape, generator=g) * 0.05)
    return experts


def _reference(x, weight, a, b, scaling, splits):
    """float64 per-expert loop: x_e @ W_e + s * (x_e @ A_e^T) @ B_e[:out]^T."""
    out = weight.shape[2]
    parts, start = [], 0
    for e, n in enumerate(splits):
        xe = x[start : start + n]
        parts.append(xe @ weight[e] + scaling * (xe @ a[e].t()) @ b[e, :out].t())
        start += n
    return torch.cat(parts)


def _check_site(linear, device: str, splits_device: bool) -> None:
    site = linear.lora
    adapter = next(iter(site.slots.values()))
    g = torch.Generator().manual_seed(2)
    rows, fan_in = sum(SPLITS), linear.weight.shape[1]
    x = torch.randn(rows, fan_in, generator=g).to(device, torch.bfloat16).requires_grad_()
    dy = torch.randn(rows, linear.weight.shape[2], generator=g).to(device, torch.bfloat16)
    splits = torch.tensor(SPLITS, device=device) if splits_device else SPLITS
    y = linear(x, splits)[0]
    y.backward(dy)

    x64 = x.detach().double().requires_grad_()
    a64 = adapter.a.detach().double().requires_grad_()
    b64 = adapter.b.detach().double().requires_grad_()
    ref = _reference(x64, linear.weight.detach().double(), a64, b64, adapter.scaling, SPLITS)
    ref.backward(dy.double())
    for name, got, want in (
        ("y", y, ref), ("dx", x.grad, x64.grad),
        ("dA", adapter.a.grad, a64.grad), ("dB", adapter.b.grad, b64.grad),
    ):  # fmt: skip
        assert got.shape == want.shape, name
        scale = max(float(want.abs().max()), 1e-3)
        err = float((got.double() - want).abs().max())
        assert err <= 2e-2 * scale, f"{site.info.path} {name}: off by {err} (scale {scale})"
    empty = SPLITS.index(0)  # an expert without tokens gets no gradient
    assert torch.count_nonzero(adapter.a.grad[empty]) == 0
    assert torch.count_nonzero(adapter.b.grad[empty]) == 0


def _check(device: str, backend: str, splits_device: bool) -> None:
    experts = _experts(device, backend)
    for linear in (experts.linear_fc1, experts.linear_fc2):
        assert linear.grouped_gemm_backend == backend
        _check_site(linear, device, splits_device)


@pytest.mark.gpu
@pytest.mark.skipif(
    not (HOPPER and _HAVE_MEGATRON),
    reason="needs an sm_90 (Hopper) GPU and megatron-core (on the GPU machine from the "
    "carry); the CPU twin is the harness test in this file",
)
@pytest.mark.parametrize("splits_device", [True, False], ids=["splits_on_device", "host_list"])
def test_grouped_lora_on_the_cutlass_kernel_equals_a_float64_loop(cuda_world, splits_device):
    from art_megatron_ext.ops.grouped_gemm import cutlass_unavailable_reason

    probe = torch.empty(8, 8, device="cuda", dtype=torch.bfloat16)
    reason = cutlass_unavailable_reason(probe, probe.expand(2, 8, 8))
    assert not reason, f"CUTLASS grouped GEMM unavailable: {reason}"
    _check("cuda", "cutlass", splits_device)


@pytest.mark.skipif(
    torch.cuda.is_available() or not _HAVE_MEGATRON,
    reason="CPU harness check (needs megatron-core); the CUDA test above runs the kernel",
)
def test_the_harness_holds_on_cpu_with_the_torch_backend(megatron_world):
    _check("cpu", "torch", splits_device=False)
