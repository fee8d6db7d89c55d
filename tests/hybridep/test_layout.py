"""The reference layout and movement functions (single process, no ranks).

`hybridep.layout` / `hybridep.movement` are the specification the CUDA kernels reproduce;
these tests check them against naive loops (hypothesis drives the routings) and prove that
the static-budget path reads nothing back to the host: on the `meta` device any
data-dependent step (`.item()`, boolean indexing, `nonzero`) raises, and it runs there
(test_layout_gpu.py runs the same pipeline on a GPU under sync debug mode).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.hybridep_static import static_inputs, static_pipeline

from hybridep import layout, movement


def _naive_positions(local_map: torch.Tensor, pad: int, budget: int | None):
    slots, experts = local_map.shape
    positions = torch.full((slots, experts), -1, dtype=torch.int64)
    counts, start, dropped = [], 0, 0
    for e in range(experts):
        rows = [i for i in range(slots) if local_map[i, e]]
        padded = -(-len(rows) // pad) * pad
        room = padded if budget is None else max(0, min(padded, budget - start))
        for k, i in enumerate(rows):
            if k < room:
                positions[i, e] = start + k
            else:
                dropped += 1
        counts.append(room)
        start += padded
    return positions, counts, dropped


@settings(max_examples=60, deadline=None)
@given(
    slots=st.integers(0, 24),
    experts=st.integers(1, 4),
    pad=st.sampled_from([1, 2, 4, 8]),
    budget_blocks=st.one_of(st.none(), st.integers(0, 12)),
    seed=st.integers(0, 2**16),
)
def test_expert_positions_match_a_naive_loop(slots, experts, pad, budget_blocks, seed):
    gen = torch.Generator().manual_seed(seed)
    local_map = torch.rand(slots, experts, generator=gen) < 0.4
    budget = None if budget_blocks is None else budget_blocks * pad
    got = layout.expert_positions(local_map, pad, budget)
    positions, counts, dropped = _naive_positions(local_map, pad, budget)
    assert torch.equal(got.positions, positions)
    assert got.tokens_per_expert.tolist() == counts
    assert int(got.overflow_flag.item()) == int(dropped > 0)


def test_sparse_to_dense_compact_counts_earlier_slots_per_destination():
    # 2 ranks x 3 tokens; need[s, t, d]
    need = torch.tensor([[[1, 0], [1, 1], [0, 1]], [[1, 1], [0, 0], [1, 0]]], dtype=torch.bool)
    assert layout.sparse_to_dense_compact(need, 0).tolist() == [[0, -1], [1, 0], [-1, 1]]
    assert layout.sparse_to_dense_compact(need, 1).tolist() == [[2, 2], [-1, -1], [3, -1]]
    assert layout.sparse_to_dense_slots(need[1], 1).tolist() == [[3, 3], [-1, -1], [5, -1]]


def test_permute_then_unpermute_sums_each_rows_experts_in_fp32():
    gen = torch.Generator().manual_seed(0)
    local_map = torch.rand(9, 3, generator=gen) < 0.5
    recv = torch.randint(-8, 9, (9, 5), generator=gen).to(torch.bfloat16)
    probs = torch.rand(9, 3, generator=gen)
    lay = layout.expert_positions(local_map, 4, None)
    total = int(lay.tokens_per_expert.sum())
    tokens, tprobs = movement.permute_tokens(recv, probs, lay.positions, total)
    used = lay.positions[lay.positions >= 0]
    padding = torch.ones(total, dtype=torch.bool)
    padding[used] = False
    assert not tokens[padding].any() and not tprobs[padding].any(), "padding rows must be zero"
    back, back_probs = movement.unpermute_tokens(tokens, tprobs, lay.positions)
    count = local_map.sum(1, keepdim=True).float()
    assert torch.equal(back, (recv.float() * count).to(torch.bfloat16))
    assert torch.equal(back_probs, probs * local_map)


def test_unpermute_rounds_once_after_an_fp32_sum():
    # 1 + 2^-8 + 2^-8 in bf16: per-term bf16 rounding would give 1.0, the fp32 sum 1 + 2^-7.
    tokens = torch.tensor([[1.0], [2.0**-8], [2.0**-8]], dtype=torch.bfloat16)
    positions = torch.tensor([[0, 1, 2]])
    back, _ = movement.unpermute_tokens(tokens, None, positions)
    assert back.item() == 1.0 + 2.0**-7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_single_pass_unpermute_sums_in_the_same_order_as_the_per_expert_path(dtype):
    torch.manual_seed(3)
    local_map = torch.rand(3000, 6) < 0.5
    lay = layout.expert_positions(local_map, 8, None)
    rows = int(lay.tokens_per_expert.sum())
    # Magnitudes spread over 2^-20..2^20 so that any change of summation order shows.
    tokens = (torch.randn(rows, 64) * 2.0 ** torch.randint(-20, 21, (rows, 1))).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        fast = movement._unpermute_sequential_index_add(tokens, lay.positions)
    finally:
        torch.set_num_threads(threads)
    slow = movement._unpermute_by_expert(tokens, lay.positions)
    assert torch.equal(
        fast.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        slow.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
    )


def test_cpu_combine_rows_equals_the_dense_rank_order_reduction():
    torch.manual_seed(5)
    world, tokens, hidden, experts = 4, 300, 32, 3
    need_own = torch.rand(tokens, world) < 0.6
    rank_of_row, token_of_row = need_own.t().nonzero(as_tuple=True)
    rows = torch.randn(len(rank_of_row), hidden) * 2.0 ** torch.randint(
        -20, 21, (len(rank_of_row), 1)
    )
    probs = torch.rand(len(rank_of_row), experts)
    out, out_probs = movement.combine_rows(rows, probs, rank_of_row, token_of_row, world, tokens)
    dense = torch.zeros(world, tokens, hidden)
    dense[rank_of_row, token_of_row] = rows
    dense_probs = torch.zeros(world, tokens, experts)
    dense_probs[rank_of_row, token_of_row] = probs
    assert torch.equal(
        out.view(torch.int32), movement.reduce_over_ranks(dense, need_own).view(torch.int32)
    )
    assert torch.equal(out_probs, movement.scatter_probs_over_ranks(dense_probs, need_own))
    via_dense = movement._combine_rows_dense(rows, rank_of_row, token_of_row, world, tokens)
    assert torch.equal(out.view(torch.int32), via_dense.view(torch.int32))
    reversed_order = movement.reduce_over_ranks(dense.flip(0), need_own.flip(1))
    assert not torch.equal(out, reversed_order), "data must be sensitive to the summation order"


def test_reduce_over_ranks_skips_unrouted_ranks_and_sums_in_rank_order():
    back = torch.tensor([[[1.0]], [[100.0]], [[2.0]]])  # [W=3, T=1, H=1]
    need = torch.tensor([[True, False, True]])
    assert movement.reduce_over_ranks(back, need).item() == 3.0


def test_static_budget_path_needs_no_host_values():
    out = static_pipeline(static_inputs("meta"))
    assert out.device.type == "meta" and tuple(out.shape) == (5, 4)


def test_static_budget_path_copies_nothing_from_the_host():
    """The pipeline's inputs are built before it runs; inside it no tensor moves from the
    host to the device (on a GPU under sync debug mode that copy raises: the first GPU run's
    set-up failure). Checked on `meta` with a dispatch mode that sees every copy."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostCopies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            sources = [a for a in args if isinstance(a, torch.Tensor) and a.device.type == "cpu"]
            results = out if isinstance(out, (tuple, list)) else [out]
            if sources and any(isinstance(r, torch.Tensor) and r.device.type == "meta"
                               for r in results):  # fmt: skip
                self.seen.append(str(func))
            return out

    inputs = static_inputs("meta")
    with HostCopies() as mode:
        static_pipeline(inputs)
    assert mode.seen == []


def test_meta_check_catches_a_host_read():
    local_map = torch.zeros(6, 2, dtype=torch.bool, device="meta")
    lay = layout.expert_positions(local_map, 1, None)
    with pytest.raises((RuntimeError, NotImplementedError)):
        int(lay.tokens_per_expert.sum())  # what the blocking path does on purpose
