"""ArtGroupedMLP equals Megatron's SequentialMLP with the same weights (CPU, fp32, torch path).

One spawned gloo rank builds Megatron's local-spec MoE layer (SequentialMLP experts) and one
from `art_moe_layer_spec` (ArtGroupedMLP experts), copies the weights across, and compares
expert outputs, full-layer outputs and every gradient; tolerance 1e-5 (fp32, same maths, only
the GEMM summation order differs).
"""

from __future__ import annotations

import pytest
import torch
from support.train_ranks import run_ranks

CASES = {
    "swiglu": dict(gated_linear_unit=True, activation_func=torch.nn.functional.silu),
    "gelu": dict(gated_linear_unit=False, activation_func=torch.nn.functional.gelu),
    "ffn_not_multiple_of_8": dict(
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        moe_ffn_hidden_size=13,
        ffn_hidden_size=13,
    ),
}


def _max_diff(a, b) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def _worker(rank: int, world_size: int, seed: int) -> dict:
    from support.megatron_cpu import build_moe_layer, cpu_shim, megatron_parallel, moe_test_config

    from art_megatron_ext.moe.grouped_mlp import (
        ArtGroupedMLP,
        GroupedMLPOptions,
        art_moe_layer_spec,
    )

    out = {}
    with cpu_shim(), megatron_parallel(tp=1, ep=1):
        for name, overrides in CASES.items():
            torch.manual_seed(seed)
            config = moe_test_config(**overrides)
            reference = build_moe_layer(config)
            ours = art_moe_layer_spec(config.num_moe_experts, GroupedMLPOptions("torch"))(
                config=config, layer_number=1
            )
            assert isinstance(ours.experts, ArtGroupedMLP)
            ours.router.load_state_dict(reference.router.state_dict())
            ours.experts.copy_from_sequential_mlp(reference.experts)

            # Experts alone, with an empty expert and a one-row expert.
            counts = torch.tensor([3, 0, 1, 5, 2, 0, 4, 1])
            x = torch.randn(int(counts.sum()), config.hidden_size)
            probs = torch.rand(x.shape[0])
            x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
            y_ref, _ = reference.experts(x_ref, counts, probs)
            y_ours, _ = ours.experts(x_ours, counts, probs)
            dy = torch.randn_like(y_ref)
            y_ref.backward(dy)
            y_ours.backward(dy)
            w1_grad = torch.stack(
                [e.linear_fc1.weight.grad.t() for e in reference.experts.local_experts]
            )
            w2_grad = torch.stack(
                [e.linear_fc2.weight.grad.t() for e in reference.experts.local_experts]
            )
            out[f"{name}/experts_out"] = _max_diff(y_ref, y_ours)
            out[f"{name}/experts_dx"] = _max_diff(x_ref.grad, x_ours.grad)
            out[f"{name}/experts_dw1"] = _max_diff(w1_grad, ours.experts.weight1.grad)
            out[f"{name}/experts_dw2"] = _max_diff(w2_grad, ours.experts.weight2.grad)
            out[f"{name}/empty_expert_dw1"] = ours.experts.weight1.grad[1].abs().max().item()

            # The whole MoE layer (router, dispatcher, experts) forward and backward.
            for p in (*reference.parameters(), *ours.parameters()):
                p.grad = None
            h = torch.randn(6, 2, config.hidden_size)
            h_ref, h_ours = h.clone().requires_grad_(), h.clone().requires_grad_()
            o_ref, _ = reference(h_ref)
            o_ours, _ = ours(h_ours)
            g = torch.randn_like(o_ref)
            o_ref.backward(g)
            o_ours.backward(g)
            out[f"{name}/layer_out"] = _max_diff(o_ref, o_ours)
            out[f"{name}/layer_dx"] = _max_diff(h_ref.grad, h_ours.grad)
            out[f"{name}/layer_router_grad"] = _max_diff(
                reference.router.weight.grad, ours.router.weight.grad
            )
    return out


@pytest.fixture(scope="module")
def diffs():
    return run_ranks(_worker, world_size=1, args=(1234,), timeout_s=300)[0]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    "what",
    [
        "experts_out",
        "experts_dx",
        "experts_dw1",
        "experts_dw2",
        "layer_out",
        "layer_dx",
        "layer_router_grad",
    ],
)
def test_grouped_mlp_matches_sequential_mlp(diffs, case, what):
    assert diffs[f"{case}/{what}"] <= 1e-5, diffs


@pytest.mark.parametrize("case", list(CASES))
def test_empty_expert_gets_exactly_zero_weight_gradient(diffs, case):
    assert diffs[f"{case}/empty_expert_dw1"] == 0.0


def test_unknown_backend_is_refused():
    from art_megatron_ext.moe.grouped_mlp import GroupedMLPOptions

    with pytest.raises(ValueError, match="backend='tpu'"):
        GroupedMLPOptions("tpu")
