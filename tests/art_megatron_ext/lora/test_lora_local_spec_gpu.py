"""LoRA on a Megatron-core GPT with the local (non-TE) spec, on CUDA (marked `gpu`).

A tiny GPT (`build_gpt`: QKV, attention output, FC1, FC2 sites, GQA, RoPE) with LoRA and
non-zero B runs forward and backward in fp32 on the GPU (TF32 off). The reference is the same
base model with every site's LoRA merged into its weight, W + s * B @ A (what LoRA computes,
by definition), run the same way: the loss must agree, and each LoRA factor's gradient must
equal the chain rule through the merged weight's gradient G (dA = s * B^T G, dB = s * G A^T).
Padded rank rows and columns are zero on both sides, so whole tensors are compared.

Needs megatron-core (carried to the GPU machine, `bench/gpu_check_unpack.py`), no Transformer
Engine, no CPU stand-ins. CPU twin: the same check in this file on CPU under the LoRA tests'
`megatron_world` (which stands in for CUDA-only calls), so a harness bug costs no device time.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from support.gpt_shapes import TINY

_HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None
CUDA_ONLY = pytest.mark.skipif(
    not (torch.cuda.is_available() and _HAVE_MEGATRON),
    reason="needs a CUDA GPU and megatron-core (on the GPU machine from the carry); the CPU "
    "twin is the harness test in this file",
)
SEQ, BATCH = 24, 2
TOLERANCE = 1e-4  # relative to the largest entry; fp32 with TF32 off


@pytest.fixture(scope="module")
def cuda_world():
    """nccl world of 1, Megatron parallel state TP=1, CUDA RNG tracker seeded; TF32 off."""
    from support.cuda_world import nccl_world_of_one

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    with nccl_world_of_one("art_lora_local_"):
        yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _models():
    """(GPT with LoRA and seeded non-zero B, a copy of its base model), both on CPU."""
    from art_megatron_ext.lora import LoraConfig, attach_lora, iter_lora_sites
    from art_megatron_ext.lora.padding import logical_view
    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt

    torch.manual_seed(0)
    model, base = build_gpt(GptShape(**TINY)), build_gpt(GptShape(**TINY))
    base.load_state_dict(model.state_dict())  # (no deepcopy: the model holds process groups)
    attach_lora(model, LoraConfig(rank=8, alpha=16.0))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for e in iter_lora_sites(model):
            view = logical_view(e.adapter.b)
            view.copy_(torch.randn(view.shape, generator=g) * 0.05)
    return model, base


def _merge(model, base) -> dict[str, torch.nn.Parameter]:
    """Add each site's s * B @ A to the base copy's weight; {site path: that weight}."""
    from art_megatron_ext.lora import iter_lora_sites

    merged = {}
    for p in base.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        for e in iter_lora_sites(model):
            weight = base.get_submodule(e.path).weight
            a, b = e.adapter.a.double(), e.adapter.b.double()
            weight.copy_(weight.double() + e.adapter.scaling * (b @ a))
            merged[e.path] = weight.requires_grad_(True)
    return merged


def _loss(model, device) -> torch.Tensor:
    from art_megatron_ext.lora.cpu_runtime import causal_mask

    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, TINY["vocab_size"], (BATCH, SEQ + 1), generator=g).to(device)
    positions = torch.arange(SEQ, device=device).expand(BATCH, SEQ)
    mask = causal_mask(SEQ).to(device)
    return model(tokens[:, :-1], positions, mask, labels=tokens[:, 1:]).float().mean()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.abs().max().clamp_min(1e-30))


def _check_lora_equals_merged_weights(device: str) -> int:
    from art_megatron_ext.lora import iter_lora_sites

    model, base = _models()
    merged = _merge(model, base)
    model, base = model.to(device), base.to(device)
    merged = {path: base.get_submodule(path).weight for path in merged}
    loss = _loss(model, device)
    loss.backward()
    ref = _loss(base, device)
    ref.backward()
    assert _rel(loss.detach(), ref.detach()) < TOLERANCE, (float(loss), float(ref))
    sites = 0
    for e in iter_lora_sites(model):
        a, b, s = e.adapter.a.detach(), e.adapter.b.detach(), e.adapter.scaling
        g = merged[e.path].grad
        assert e.adapter.a.device.type == device, e.path
        want_da, want_db = s * (b.double().t() @ g.double()), s * (g.double() @ a.double().t())
        assert _rel(e.adapter.a.grad, want_da) < TOLERANCE, f"{e.path}: dA"
        assert _rel(e.adapter.b.grad, want_db) < TOLERANCE, f"{e.path}: dB"
        sites += 1
    return sites


@pytest.mark.gpu
@CUDA_ONLY
def test_lora_on_cuda_equals_the_merged_weights(cuda_world):
    assert _check_lora_equals_merged_weights("cuda") == 4 * TINY["num_hidden_layers"]


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU harness check; the CUDA test above runs the model"
)
def test_the_harness_holds_on_cpu(megatron_world):
    assert _check_lora_equals_merged_weights("cpu") == 4 * TINY["num_hidden_layers"]
