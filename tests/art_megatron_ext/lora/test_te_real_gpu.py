"""LoRA on real Transformer Engine linears (GPU twin of test_te_linears.py; marked `gpu`).

Runs only where CUDA and `transformer_engine` are installed (the `gpu` extra); on CPU it is
skipped with the reason. It checks what the CPU tests take from `support/te_standin.py`:
- the stand-in computes what Megatron's TE wrappers compute (same weights, same outputs and
  forward contract, including `return_layernorm_output` and `(out, bias)`);
- LoRA attaches to each TE linear kind and, on the layernorm-fused one, reads TE's own
  normalized input (the delta equals LoRA applied to RMSNorm(x)), forward and backward.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

_HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and _HAVE_TE),
        reason="needs a CUDA GPU and transformer_engine (the `gpu` extra); the CPU twin is "
        "test_te_linears.py with the TE stand-in",
    ),
]


@pytest.fixture(scope="module")
def world():
    from support.cuda_world import nccl_world_of_one

    with nccl_world_of_one("art_te_"):
        torch.backends.cuda.matmul.allow_tf32 = False
        yield


def _config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        normalization="RMSNorm",
        add_bias_linear=True,
        gated_linear_unit=False,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        num_moe_experts=4,
        moe_ffn_hidden_size=32,
    )


def _pair(name: str, **kwargs):
    """(real TE wrapper, stand-in) built with the same arguments and the same weights."""
    from megatron.core.extensions import transformer_engine as real
    from support import te_standin

    config = _config()
    kwargs = {"config": config, "init_method": config.init_method, **kwargs}
    args = kwargs.pop("args")
    te = getattr(real, name)(*args, **kwargs).cuda()
    standin = getattr(te_standin, name)(*args, **kwargs).cuda()
    state = {k: v for k, v in te.state_dict().items() if "_extra_state" not in k}
    standin.load_state_dict(state, strict=True)
    return te, standin


CASES = {
    "column": (
        "TEColumnParallelLinear",
        dict(args=(64, 48), gather_output=False, bias=True, skip_bias_add=True, is_expert=False),
    ),
    "row": (
        "TERowParallelLinear",
        dict(
            args=(48, 64), bias=True, input_is_parallel=True, skip_bias_add=False, is_expert=False
        ),
    ),
    "layernorm_column": (
        "TELayerNormColumnParallelLinear",
        dict(args=(64, 48), gather_output=False, bias=True, skip_bias_add=False, is_expert=False),
    ),
    "grouped_column": (
        "TEColumnParallelGroupedLinear",
        dict(args=(4, 64, 48), bias=False, skip_bias_add=False, is_expert=True),
    ),
}


def _flat(output) -> list:
    """Every tensor (or None) of a (possibly nested) TE output tuple, in order."""
    items = output if isinstance(output, tuple) else (output,)
    return [t for item in items for t in (item if isinstance(item, tuple) else (item,))]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layernorm_output", [False, True])
def test_standin_matches_megatron_te_wrapper(world, case, layernorm_output):
    name, kwargs = CASES[case]
    if layernorm_output and case != "layernorm_column":
        pytest.skip("return_layernorm_output exists on the layernorm-fused linear only")
    te, standin = _pair(name, **dict(kwargs))
    for attr in (
        "parallel_mode",
        "te_return_bias",
        "sequence_parallel",
        "in_features",
        "out_features",
        "tp_size",
    ):
        assert getattr(standin, attr) == getattr(te, attr), attr
    te.return_layernorm_output = standin.return_layernorm_output = layernorm_output
    x = torch.randn(10, 64 if case != "row" else 48, device="cuda")
    extra = ([3, 0, 5, 2],) if case.startswith("grouped") else ()
    got, want = standin(x, *extra), te(x, *extra)
    assert [t is None for t in _flat(got)] == [t is None for t in _flat(want)]
    for g, w in zip(_flat(got), _flat(want), strict=True):
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_lora_on_real_te_layernorm_linear_reads_the_normalized_input(world):
    from art_megatron_ext.lora import LoraConfig, activate_slot, attach_lora
    from art_megatron_ext.lora.padding import logical_view

    name, kwargs = CASES["layernorm_column"]
    te, _ = _pair(name, **dict(kwargs))
    holder = torch.nn.Module()
    holder.mlp = torch.nn.Module()
    holder.mlp.linear_fc1 = te
    (site,) = attach_lora(holder, LoraConfig(rank=4, alpha=8.0, targets=("linear_fc1",)))
    adapter = site.slots["default"]
    with torch.no_grad():
        logical_view(adapter.b).normal_()
    x = torch.randn(10, 2, 64, device="cuda", requires_grad=True)
    with torch.no_grad(), activate_slot(holder, None):
        base, _ = te(x)
    out, bias = te(x)
    assert bias is None
    normed = F.rms_norm(x, (64,), te.layer_norm_weight, te.eps)
    a, b = logical_view(adapter.a), logical_view(adapter.b)
    want = F.linear(F.linear(normed, a) * adapter.scaling, b)
    torch.testing.assert_close(out - base, want, rtol=1e-4, atol=1e-5)
    out.sum().backward()
    assert adapter.a.grad is not None and adapter.a.grad.abs().sum() > 0
    assert x.grad is not None and torch.isfinite(x.grad).all()
