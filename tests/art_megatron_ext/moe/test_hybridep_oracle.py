"""Oracle: a real Megatron `MoELayer` with flex + hybridep equals Megatron's alltoall.

Both layers share weights and routing (forced through Megatron's `RouterReplay`), run on
spawned gloo ranks on CPU in fp32 under the test shim; dispatch and combine are pure data
movement plus fp32 sums in the same order, so output, input gradient and every weight
gradient must match with a 0.0 difference at EP=2 and EP=4. At EP=2 x TP=2 the flex path
sums the experts' TP partial outputs in another association than alltoall, so there the
tolerance is 1e-5 relative (observed: a few fp32 ulps). A case that perturbs our dispatched
tokens by 1% checks that the comparison can fail.
"""

from __future__ import annotations

import pytest
import torch
from support.moe_replay import alltoall_and_flex_layers, topk_indices
from support.moe_replay import rel_diff as _rel
from support.moe_replay import run_with_replay as _run_layer
from support.train_ranks import run_ranks

HIDDEN = 16
TOKENS = 12
TOPK = 2


def _cases(num_experts: int, experts_per_rank: int) -> dict[str, list[int]]:
    """Allowed experts per case; experts outside the list receive no token."""
    all_experts = list(range(num_experts))
    return {
        "uniform": all_experts,
        "some_experts_idle": [e for e in all_experts if e % 3 != 1],
        "last_rank_idle": all_experts[: num_experts - experts_per_rank],
        "two_experts_only": [0, num_experts - 1],
    }


def _oracle_worker(rank: int, world_size: int, ep: int, tp: int) -> dict:
    from megatron.core.transformer.moe import fused_a2a
    from support.megatron_cpu import cpu_shim, megatron_parallel

    from art_megatron_ext.moe import HybridEPOptions, enable_hybridep

    num_experts = 8
    common = dict(
        expert_model_parallel_size=ep,
        tensor_model_parallel_size=tp,
        num_moe_experts=num_experts,
        hidden_size=HIDDEN,
        moe_router_topk=TOPK,
        moe_enable_routing_replay=True,
        init_method_std=0.2,  # outputs of order 1, so a 1% change is far above rounding
    )
    results: dict = {}
    with cpu_shim(), megatron_parallel(tp=tp, ep=ep), enable_hybridep(HybridEPOptions("torch")):
        ref, flex = alltoall_and_flex_layers(**common)
        results["flex_manager"] = type(flex.token_dispatcher._comm_manager).__name__
        for case, allowed in _cases(num_experts, num_experts // ep).items():
            gen = torch.Generator().manual_seed(100 * rank + len(case))
            x = torch.randn(TOKENS, 1, HIDDEN, generator=gen)
            grad_out = torch.randn(TOKENS, 1, HIDDEN, generator=gen)
            topk_idx = topk_indices(allowed, TOKENS, TOPK, gen)
            out_ref, dx_ref, g_ref = _run_layer(ref, x, topk_idx, grad_out)
            out_hep, dx_hep, g_hep = _run_layer(flex, x, topk_idx, grad_out)
            assert g_ref.keys() == g_hep.keys(), (g_ref.keys(), g_hep.keys())
            counts = torch.bincount(topk_idx.reshape(-1), minlength=num_experts)
            torch.distributed.all_reduce(counts)
            results[case] = {
                "idle_experts": int((counts == 0).sum()),
                "out": _rel(out_ref, out_hep),
                "x_grad": _rel(dx_ref, dx_hep),
                "weight_grads": {n: _rel(g_ref[n], g_hep[n]) for n in g_ref},
                "out_abs": out_ref.abs().max().item(),
            }
        # Sensitivity: scale what our buffer dispatches by 1.01; the oracle must notice.
        buffer = fused_a2a._hybrid_ep_buffer
        original = buffer.backend.dispatch

        def perturbed(hidden, probs, handle):
            recv, recv_probs = original(hidden, probs, handle)
            return recv * 1.01, recv_probs

        buffer.backend.dispatch = perturbed
        gen = torch.Generator().manual_seed(7 + rank)
        x = torch.randn(TOKENS, 1, HIDDEN, generator=gen)
        grad_out = torch.randn(TOKENS, 1, HIDDEN, generator=gen)
        topk_idx = topk_indices(list(range(num_experts)), TOKENS, TOPK, gen)
        out_ref, _, _ = _run_layer(ref, x, topk_idx, grad_out)
        out_hep, _, _ = _run_layer(flex, x, topk_idx, grad_out)
        buffer.backend.dispatch = original
        results["perturbed_out"] = (out_ref - out_hep).abs().max().item()
        results["perturbed_out_abs"] = out_ref.abs().max().item()
    return results


def _megatron_functions_with_budget(rank: int, world_size: int) -> dict:
    """Megatron's `hybrid_ep_dispatch/combine` autograd path, blocking vs static budget."""
    from megatron.core.transformer.moe import fused_a2a

    from art_megatron_ext.moe import HybridEPOptions, enable_hybridep

    local, pad = 3, 4
    experts = world_size * local
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    scores = torch.rand(TOKENS, experts, generator=gen)
    routing = torch.zeros(TOKENS, experts, dtype=torch.bool)
    routing.scatter_(1, scores.topk(TOPK, dim=1).indices, True)
    probs = scores * routing
    grad_out = torch.randn(TOKENS, HIDDEN, generator=gen)
    group = torch.distributed.group.WORLD

    def run(budget):
        x_, p_ = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        tokens, dprobs, _, _, handle = fused_a2a.hybrid_ep_dispatch(
            x_, routing, p_, group, local, num_permuted_tokens=budget, pad_multiple=pad
        )
        expert_out = tokens * dprobs.unsqueeze(1) * 3.0  # a weighted "expert"
        out = fused_a2a.hybrid_ep_combine(expert_out, handle, budget, pad)
        out.backward(grad_out)
        return out.detach(), x_.grad, p_.grad, int(handle[-1].item())

    with enable_hybridep(HybridEPOptions("torch")):
        blocking = run(None)
        static = run(pad * 2 * TOKENS)  # room for every pair: no drop
        tight = run(pad)  # one block: drops on a rank that receives more
    return {
        "static_equals_blocking": all(
            torch.equal(a, b) for a, b in zip(blocking[:3], static[:3], strict=True)
        ),
        "grads_nonzero": bool(blocking[1].abs().sum() > 0 and blocking[2].abs().sum() > 0),
        "flags": (blocking[3], static[3], tight[3]),
    }


def _growing_batches(rank: int, world_size: int) -> dict:
    """Megatron sizes the buffer from the first batch (`init_hybrid_ep_buffer(num_tokens=
    x.shape[-2])`); a second forward with more tokens must grow it (collectively, logged
    once) and still equal alltoall. Then Megatron's reset closes the buffer it drops."""
    import logging

    from megatron.core.transformer.moe import fused_a2a
    from support.megatron_cpu import cpu_shim, megatron_parallel

    from art_megatron_ext.moe import HybridEPOptions, enable_hybridep

    messages: list[str] = []

    class Records(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Records()
    logging.getLogger("hybridep.buffer").addHandler(handler)
    common = dict(
        expert_model_parallel_size=2,
        num_moe_experts=8,
        hidden_size=HIDDEN,
        moe_router_topk=TOPK,
        moe_enable_routing_replay=True,
        init_method_std=0.2,
    )
    out: dict = {"diffs": []}
    with cpu_shim(), megatron_parallel(tp=1, ep=2), enable_hybridep(HybridEPOptions("torch")):
        ref, flex = alltoall_and_flex_layers(**common)
        for step, tokens in enumerate((TOKENS, 40, 40)):  # the second forward is larger
            gen = torch.Generator().manual_seed(50 * rank + step)
            x = torch.randn(tokens, 1, HIDDEN, generator=gen)
            grad_out = torch.randn(tokens, 1, HIDDEN, generator=gen)
            topk_idx = topk_indices(list(range(8)), tokens, TOPK, gen)
            out_ref, dx_ref, g_ref = _run_layer(ref, x, topk_idx, grad_out)
            out_hep, dx_hep, g_hep = _run_layer(flex, x, topk_idx, grad_out)
            worst = max([_rel(out_ref, out_hep), _rel(dx_ref, dx_hep)]
                        + [_rel(g_ref[n], g_hep[n]) for n in g_ref])  # fmt: skip
            out["diffs"].append(worst)
            if step == 0:
                out["first_capacity"] = fused_a2a._hybrid_ep_buffer.max_num_of_tokens_per_rank
        buffer = fused_a2a._hybrid_ep_buffer
        out["capacity"] = buffer.max_num_of_tokens_per_rank
        out["logged"] = [m for m in messages if "growing the buffer" in m]
        fused_a2a.reset_hybrid_ep_buffer()  # what a trainer calls to drop the buffer
        out["reset_closed"] = buffer._closed and fused_a2a._hybrid_ep_buffer is None
    logging.getLogger("hybridep.buffer").removeHandler(handler)
    return out


def _ep2_worker(rank: int, world_size: int) -> dict:
    from support.megatron_cpu import cpu_shim

    results = _oracle_worker(rank, world_size, 2, 1)
    with cpu_shim():
        results["budget"] = _megatron_functions_with_budget(rank, world_size)
    results["growth"] = _growing_batches(rank, world_size)
    return results


@pytest.fixture(scope="module")
def ep2_results() -> list[dict]:
    """2 spawned gloo ranks, EP=2."""
    return run_ranks(_ep2_worker, 2, timeout_s=300)


def _four_rank_worker(rank: int, world_size: int) -> dict:
    """EP=4, then EP=2 x TP=2, in one spawn (spawning and importing dominate the cost)."""
    return {
        "ep4": _oracle_worker(rank, world_size, 4, 1),
        "ep2_tp2": _oracle_worker(rank, world_size, 2, 2),
    }


@pytest.fixture(scope="module")
def four_rank_results() -> list[dict]:
    """4 spawned gloo ranks."""
    return run_ranks(_four_rank_worker, 4, timeout_s=500)


@pytest.fixture(scope="module")
def ep2_tp2_results(four_rank_results) -> list[dict]:
    """EP=2 x TP=2 (sequence parallel; the flex group is TP x EP)."""
    return [r["ep2_tp2"] for r in four_rank_results]


@pytest.fixture(scope="module")
def ep4_results(four_rank_results) -> list[dict]:
    """EP=4."""
    return [r["ep4"] for r in four_rank_results]


CASES = list(_cases(8, 4))


# With TP > 1 the flex dispatcher sums the TP partial outputs of the experts inside combine
# (ranks in rank order) where alltoall reduce-scatters them first: the same fp32 terms,
# associated differently, so results agree to a few ulps instead of bitwise.
TP_RELATIVE_TOLERANCE = 1e-5


def _assert_exact(results: list[dict], case: str, tolerance: float = 0.0) -> None:
    for rank, res in enumerate(results):
        got = res[case]
        assert got["out_abs"] > 0.1, f"rank {rank}: the layer output is ~zero, nothing compared"
        if case != "uniform":
            assert got["idle_experts"] > 0, f"{case}: every expert got a token"
        assert got["out"] <= tolerance, f"rank {rank} {case}: output differs by {got['out']}"
        assert got["x_grad"] <= tolerance, f"rank {rank} {case}: input grad: {got['x_grad']}"
        assert got["weight_grads"], f"rank {rank}: no weight gradients were compared"
        bad = {n: d for n, d in got["weight_grads"].items() if d > tolerance}
        assert not bad, f"rank {rank} {case}: weight grads differ: {bad}"


def test_flex_dispatcher_uses_the_hybridep_manager(ep2_results):
    assert all(r["flex_manager"] == "_HybridEPManager" for r in ep2_results)


@pytest.mark.parametrize("case", CASES)
def test_ep2_output_and_every_gradient_equal_alltoall(ep2_results, case):
    _assert_exact(ep2_results, case)


@pytest.mark.parametrize("case", CASES)
def test_ep2_tp2_output_and_every_gradient_match_alltoall_to_fp32_reassociation(
    ep2_tp2_results, case
):
    _assert_exact(ep2_tp2_results, case, TP_RELATIVE_TOLERANCE)


def test_ep2_oracle_detects_a_one_percent_change_in_dispatched_tokens(ep2_results):
    for rank, res in enumerate(ep2_results):
        relative = res["perturbed_out"] / res["perturbed_out_abs"]
        assert relative > 1e-3, f"rank {rank}: a 1% change moved the output by only {relative}"


@pytest.mark.parametrize("case", CASES)
def test_ep4_output_and_every_gradient_equal_alltoall(ep4_results, case):
    _assert_exact(ep4_results, case)


def test_megatron_autograd_functions_static_budget_equals_blocking(ep2_results):
    for rank, res in enumerate(ep2_results):
        assert res["budget"]["grads_nonzero"], f"rank {rank}: nothing flowed back"
        assert res["budget"]["static_equals_blocking"], f"rank {rank}: {res['budget']}"


def test_megatron_sees_the_overflow_flag_only_when_the_budget_is_too_small(ep2_results):
    flags = [res["budget"]["flags"] for res in ep2_results]
    assert all(blocking == 0 and static == 0 for blocking, static, _ in flags), flags
    assert any(tight != 0 for _, _, tight in flags), flags


def test_a_larger_second_batch_grows_the_buffer_and_still_equals_alltoall(ep2_results):
    for rank, res in enumerate(ep2_results):
        got = res["growth"]
        assert got["first_capacity"] == TOKENS, got  # sized from the first batch, as Megatron does
        assert got["capacity"] == 64, got  # 40 tokens, rounded up to the 64-token chunk
        assert got["diffs"] == [0.0, 0.0, 0.0], f"rank {rank}: {got['diffs']}"
        assert len(got["logged"]) == 1 and "40 tokens per rank" in got["logged"][0], got


def test_megatron_reset_closes_the_buffer_it_drops(ep2_results):
    assert all(res["growth"]["reset_closed"] for res in ep2_results)
