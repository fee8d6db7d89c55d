"""Tree attention through FlexAttention with a `BlockMask` built from the `TreePlan`
(`flex_tree_attention.py`), against the tiled kernel (the oracle) on real packed batches.

On CPU FlexAttention runs its forward eagerly (no backward: torch 2.14), so the CPU tests
compare forwards and check that the mask visits exactly the plan's tiles and that the backend
choice never trains on a path that cannot; the CUDA twin compares forward and backward,
compiled, in bf16 (`bench/gpu_check.sh` runs it with the other GPU tests).
"""

import numpy as np
import pytest
import torch

from art_megatron_ext.packing import PackingConfig, pack_groups, plan_tree_attention
from art_megatron_ext.packing.flex_tree_attention import (
    flex_tree_attention,
    tree_attention_backend,
    tree_block_mask,
)
from art_megatron_ext.packing.tree_attention import TreeAttentionConfig, tree_attention

from .builders import VOCAB, make_multi_turn_group, make_single_turn_group

BLOCK = 16  # small blocks: many skipped tiles in a short row


@pytest.fixture(scope="module")
def batch():
    """2 rows of 200 (not a multiple of the block): shared prompts, chats, padding."""
    rng = np.random.default_rng(1)
    groups = [
        make_single_turn_group(rng, prompt_len=16, completion_lens=(20, 7, 30)) for _ in range(4)
    ]
    groups += [make_multi_turn_group(rng, turns=3) for _ in range(2)]
    return pack_groups(groups, PackingConfig(seq_len=200, vocab_size=VOCAB))


def _inputs(rows, seq, dtype, device="cpu", heads=4, kv_heads=2, dim=16):
    g = torch.Generator().manual_seed(0)
    make = lambda h: torch.randn(rows, h, seq, dim, generator=g, dtype=torch.float32)  # noqa: E731
    return [make(h).to(device, dtype).requires_grad_() for h in (heads, kv_heads, kv_heads)]


def _visible(ends_row: torch.Tensor, qb: int, kb: int) -> torch.Tensor:
    """The packing rule on one tile: `[block, block]` booleans, False outside the row."""
    seq = ends_row.shape[0]
    queries = torch.arange(qb * BLOCK, (qb + 1) * BLOCK)[:, None]
    keys = torch.arange(kb * BLOCK, (kb + 1) * BLOCK)[None, :]
    inside = (queries < seq) & (keys < seq)
    return inside & (keys <= queries) & (queries < ends_row[keys.clamp(max=seq - 1)])


@pytest.mark.parametrize("rows_per_call", [1, 3])
def test_the_masks_visit_exactly_the_plans_tiles_and_skip_the_mask_on_full_ones(
    batch, rows_per_call
):
    """Every call's BlockMask visits the plan's tiles of its rows; a tile in which every pair
    is visible is a full block (no mask_mod), every partial one has a pair to mask; the
    padding rows of the last call see only the diagonal."""
    ends = batch.subtree_end
    plan = plan_tree_attention(ends, BLOCK)
    mask = tree_block_mask(ends, plan, rows_per_call=rows_per_call)
    rows, seq = ends.shape
    assert mask.rows == rows and len(mask.block_masks) == -(-rows // rows_per_call)
    full_tiles = 0
    for call, block_mask in enumerate(mask.block_masks):
        partial = (block_mask.kv_num_blocks, block_mask.kv_indices)
        full = (block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
        for i in range(rows_per_call):
            r = call * rows_per_call + i
            per_query_block = plan.key_blocks[r] if r < rows else None
            for qb in range(-(-seq // BLOCK)):
                got = {}
                for kind, (counts, indices) in (("partial", partial), ("full", full)):
                    n = int(counts[i, 0, qb])
                    got[kind] = set(indices[i, 0, qb, :n].tolist())
                assert not got["partial"] & got["full"]
                want = per_query_block[qb].tolist() if r < rows else [qb]
                assert sorted(got["partial"] | got["full"]) == want
                if r >= rows:
                    continue
                for kb in got["full"]:
                    assert bool(_visible(ends[r], qb, kb).all())
                for kb in got["partial"]:
                    tile = _visible(ends[r], qb, kb)
                    assert tile.any() and not bool(tile.all())
                full_tiles += len(got["full"])
    assert full_tiles > 0  # the batch has shared prompts: whole tiles are visible


def test_a_block_flex_attention_cannot_tile_is_refused_by_name(batch):
    for block in (16, 64, 128, 384):
        tree_block_mask(batch.subtree_end, plan_tree_attention(batch.subtree_end, block))
    for block in (7, 48, 200):
        plan = plan_tree_attention(batch.subtree_end, block)
        with pytest.raises(ValueError, match=f"TreeAttentionConfig.block={block} .*power of two"):
            tree_block_mask(batch.subtree_end, plan)


@pytest.mark.parametrize("rows_per_call", [1, 3])
def test_flex_forward_equals_the_tiled_kernel_on_cpu(batch, rows_per_call):
    rows, seq = batch.subtree_end.shape
    q, k, v = (x.detach() for x in _inputs(rows, seq, torch.float32))  # forward only on CPU
    plan = plan_tree_attention(batch.subtree_end, BLOCK)
    scale = 0.25
    want = tree_attention(
        q, k, v, batch.subtree_end, scale=scale, plan=plan,
        config=TreeAttentionConfig(BLOCK, 4 * BLOCK),
    )  # fmt: skip
    mask = tree_block_mask(batch.subtree_end, plan, rows_per_call=rows_per_call)
    got = flex_tree_attention(q, k, v, mask, scale=scale, compiled=False)
    assert (got - want).abs().max() < 1e-5


def _rows(batch, n: int) -> torch.Tensor:
    """`subtree_end` of `n` rows, taken in turn from the packed batch's rows."""
    ends = batch.subtree_end
    return ends[[i % ends.shape[0] for i in range(n)]]


def _steps_with_different_row_counts(batch, device, dtype, counts, *, backward: bool):
    """Runs compiled FlexAttention once per step, each step with `counts[i]` rows, and returns
    how many frames Dynamo compiled and the largest difference from the tiled kernel."""
    from torch._dynamo.utils import counters

    from art_megatron_ext.packing import flex_tree_attention as module

    torch._dynamo.reset()
    module._compiled_flex.cache_clear()
    counters.clear()
    worst = 0.0
    for rows in counts:
        ends = _rows(batch, rows)
        plan = plan_tree_attention(ends, BLOCK)
        q, k, v = _inputs(rows, ends.shape[1], dtype, device)
        if not backward:
            q, k, v = (x.detach() for x in (q, k, v))
        got = flex_tree_attention(
            q, k, v, tree_block_mask(ends.to(device), plan), scale=0.25, compiled=True
        )
        if backward:
            got.float().sum().backward()
        want = tree_attention(q.detach(), k.detach(), v.detach(), ends.to(device), scale=0.25,
                              plan=plan)  # fmt: skip
        worst = max(worst, float((got.detach().float() - want.float()).abs().max()))
    return counters["frames"]["ok"], worst


def test_compiled_flex_compiles_once_over_steps_with_different_row_counts(batch):
    """Five steps of 3, 1, 2, 5 and 4 rows: one compile (Inductor's CPU FlexAttention,
    forward only), and every step agrees with the tiled kernel. Before fixed-size calls each
    row count compiled again, and past Dynamo's limit FlexAttention ran eagerly with full
    S x S scores."""
    compiles, worst = _steps_with_different_row_counts(
        batch, "cpu", torch.float32, [3, 1, 2, 5, 4], backward=False
    )
    assert compiles == 1
    assert worst < 1e-5


def test_the_backend_is_flex_on_cuda_and_never_forced_where_it_cannot_train():
    assert tree_attention_backend("auto", torch.device("cuda", 0)) == "flex"
    assert tree_attention_backend("auto", torch.device("cpu")) == "tiled"
    assert tree_attention_backend("tiled", torch.device("cuda", 0)) == "tiled"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        tree_attention_backend("flex", torch.device("cpu"))
    with pytest.raises(ValueError, match="expected one of"):
        TreeAttentionConfig(backend="sdpa")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CPU twin above)")
def test_flex_forward_and_backward_equal_the_tiled_kernel_on_cuda(batch):
    rows, seq = batch.subtree_end.shape
    ends = batch.subtree_end.cuda()
    q, k, v = _inputs(rows, seq, torch.bfloat16, "cuda")
    upstream = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    plan = plan_tree_attention(batch.subtree_end, 128)
    scale = 0.25
    got = flex_tree_attention(q, k, v, tree_block_mask(ends, plan, rows_per_call=2), scale=scale)
    got_grads = torch.autograd.grad((got.float() * upstream.float()).sum(), (q, k, v))
    want = tree_attention(q, k, v, ends, scale=scale, plan=plan)
    want_grads = torch.autograd.grad((want.float() * upstream.float()).sum(), (q, k, v))
    assert (got.float() - want.float()).abs().max() < 2e-2  # bf16 inputs, fp32 softmax
    for a, b in zip(got_grads, want_grads, strict=True):
        assert (a.float() - b.float()).abs().max() < 5e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CPU twin above)")
def test_compiled_flex_compiles_once_over_steps_with_different_row_counts_on_cuda(batch):
    """The CUDA twin of the compile count, forward and backward in bf16 (the Triton lowering,
    not the CPU one)."""
    compiles, worst = _steps_with_different_row_counts(
        batch, "cuda", torch.bfloat16, [3, 1, 2, 5, 4, 6, 7, 9, 10], backward=True
    )
    assert compiles == 1
    assert worst < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CPU twin above)")
def test_a_rows_output_does_not_depend_on_how_rows_are_grouped_into_calls_on_cuda(batch):
    """Rows never interact: one row per call and three rows per call (the last call padded)
    give bitwise the same output."""
    ends = _rows(batch, 4).cuda()
    plan = plan_tree_attention(ends.cpu(), 128)
    q, k, v = (x.detach() for x in _inputs(4, ends.shape[1], torch.bfloat16, "cuda"))
    one = flex_tree_attention(q, k, v, tree_block_mask(ends, plan, rows_per_call=1), scale=0.25)
    three = flex_tree_attention(q, k, v, tree_block_mask(ends, plan, rows_per_call=3), scale=0.25)
    assert torch.equal(one, three)
