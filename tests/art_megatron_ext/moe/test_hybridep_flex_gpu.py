"""Megatron's flex token dispatcher on the HybridEP CUDA backend at EP=1, on sm_90 (`gpu`).

A real `MoELayer` (local spec, `SequentialMLP` experts, bf16) with
`moe_token_dispatcher_type="flex"`, `moe_flex_dispatcher_backend="hybridep"` and
`enable_hybridep(HybridEPOptions(backend="cuda"))` runs forward and backward on the GPU in a
one-rank NCCL world; the same weights and the same routing (forced through Megatron's
`RouterReplay`) through Megatron's alltoall dispatcher are the reference. Dispatch and combine
move data and sum the top-k contributions; both sides are bf16, so the tolerance is bf16's
(2e-2 of the largest entry) for output, input gradient and every weight gradient. Cases:
every expert used, and some experts idle.

Needs megatron-core (carried to the GPU machine, `bench/gpu_check_unpack.py`) and the HybridEP
kernel library (built or found in the carried cache); no Transformer Engine, no CPU shim.
CPU twin: test_hybridep_oracle.py (the same comparison at EP=2 and EP=4, torch backend, fp32,
bitwise) and test_hybridep_hookup.py (the patch itself).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from support.moe_replay import alltoall_and_flex_layers, rel_diff, run_with_replay, topk_indices

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
_HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (HOPPER and _HAVE_MEGATRON),
        reason="needs an sm_90 (Hopper) GPU and megatron-core (on the GPU machine from the "
        "carry); CPU twin: test_hybridep_oracle.py",
    ),
]

HIDDEN, FFN, EXPERTS, TOPK, TOKENS = 128, 64, 8, 2, 64
TOLERANCE = 2e-2  # bf16 on both sides, relative to the largest entry


@pytest.fixture(scope="module")
def layers():
    """(alltoall MoELayer, flex + hybridep MoELayer) with the same weights, on the GPU."""
    from support.cuda_world import nccl_world_of_one

    from art_megatron_ext.moe import HybridEPOptions, enable_hybridep

    common = dict(
        num_moe_experts=EXPERTS,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        moe_ffn_hidden_size=FFN,
        moe_router_topk=TOPK,
        moe_enable_routing_replay=True,
        params_dtype=torch.bfloat16,
        bf16=True,
        init_method_std=0.2,
    )
    with nccl_world_of_one("art_flex_"), enable_hybridep(HybridEPOptions(backend="cuda")):
        ref, flex = alltoall_and_flex_layers(**common)
        yield ref.cuda(), flex.cuda()  # leaving enable_hybridep closes Megatron's buffer


@pytest.mark.parametrize("allowed", [list(range(EXPERTS)), [0, 3, 4, 7]], ids=["all", "idle"])
def test_flex_hybridep_cuda_equals_alltoall(layers, allowed):
    from megatron.core.transformer.moe import fused_a2a

    ref, flex = layers
    assert type(flex.token_dispatcher._comm_manager).__name__ == "_HybridEPManager"
    g = torch.Generator().manual_seed(len(allowed))
    x = torch.randn(TOKENS, 1, HIDDEN, generator=g).to("cuda", torch.bfloat16)
    grad_out = torch.randn(TOKENS, 1, HIDDEN, generator=g).to("cuda", torch.bfloat16)
    topk_idx = topk_indices(allowed, TOKENS, TOPK, g).cuda()
    out_ref, dx_ref, g_ref = run_with_replay(ref, x, topk_idx, grad_out)
    out_hep, dx_hep, g_hep = run_with_replay(flex, x, topk_idx, grad_out)
    backend = type(fused_a2a._hybrid_ep_buffer.backend).__name__
    assert backend == "CudaBackend", f"Megatron's buffer runs on {backend}, not the CUDA backend"
    assert out_ref.abs().max() > 0.1  # outputs of order 1: a wrong route is far above bf16
    assert rel_diff(out_ref, out_hep) < TOLERANCE, "output"
    assert rel_diff(dx_ref, dx_hep) < TOLERANCE, "input gradient"
    assert g_ref.keys() == g_hep.keys()
    for name in g_ref:
        assert rel_diff(g_ref[name], g_hep[name]) < TOLERANCE, name
