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


def test_the_block_mask_visits_exactly_the_plans_tiles(batch):
    plan = plan_tree_attention(batch.subtree_end, BLOCK)
    mask = tree_block_mask(batch.subtree_end, plan)
    counts, indices = mask.kv_num_blocks, mask.kv_indices
    for r, per_query_block in enumerate(plan.key_blocks):
        for qb, key_blocks in enumerate(per_query_block):
            n = int(counts[r, 0, qb])
            assert sorted(indices[r, 0, qb, :n].tolist()) == key_blocks.tolist()
    assert int(counts.sum()) == plan.visible_tiles < plan.total_tiles  # tiles are skipped


def test_flex_forward_equals_the_tiled_kernel_on_cpu(batch):
    rows, seq = batch.subtree_end.shape
    q, k, v = (x.detach() for x in _inputs(rows, seq, torch.float32))  # forward only on CPU
    plan = plan_tree_attention(batch.subtree_end, BLOCK)
    scale = 0.25
    want = tree_attention(
        q, k, v, batch.subtree_end, scale=scale, plan=plan,
        config=TreeAttentionConfig(BLOCK, 4 * BLOCK),
    )  # fmt: skip
    got = flex_tree_attention(
        q, k, v, tree_block_mask(batch.subtree_end, plan), scale=scale, compiled=False
    )
    assert (got - want).abs().max() < 1e-5


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
    got = flex_tree_attention(q, k, v, tree_block_mask(ends, plan), scale=scale)
    got_grads = torch.autograd.grad((got.float() * upstream.float()).sum(), (q, k, v))
    want = tree_attention(q, k, v, ends, scale=scale, plan=plan)
    want_grads = torch.autograd.grad((want.float() * upstream.float()).sum(), (q, k, v))
    assert (got.float() - want.float()).abs().max() < 2e-2  # bf16 inputs, fp32 softmax
    for a, b in zip(got_grads, want_grads, strict=True):
        assert (a.float() - b.float()).abs().max() < 5e-2
