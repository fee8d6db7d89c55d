"""The blockwise tree-attention kernel and the predecessor-logprob gather, against dense
references on real packed batches (no Megatron here; see test_tree_attention_megatron.py)."""

import numpy as np
import pytest
import torch

from art_megatron_ext.packing import (
    PackingConfig,
    TreeAttentionConfig,
    pack_groups,
    plan_tree_attention,
    predecessor_logprobs,
    tree_attention_mask,
)
from art_megatron_ext.packing.tree_attention import tree_attention

from .builders import VOCAB, make_multi_turn_group, make_single_turn_group


@pytest.fixture(scope="module")
def batch():
    """3 rows of 300: single-turn groups (shared prompts), chats, a split group, padding."""
    rng = np.random.default_rng(0)
    groups = [
        make_single_turn_group(rng, prompt_len=20, completion_lens=(30, 9, 50, 7)) for _ in range(6)
    ]
    groups += [make_multi_turn_group(rng, turns=4) for _ in range(4)]
    return pack_groups(groups, PackingConfig(seq_len=300, vocab_size=VOCAB))


def _dense(q, k, v, subtree_end):
    repeat = q.shape[1] // k.shape[1]
    mask = tree_attention_mask(subtree_end)[:, None]
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _inputs(rows, seq, dtype, heads=4, kv_heads=2, dim=8):
    g = torch.Generator().manual_seed(0)
    make = lambda h: torch.randn(rows, h, seq, dim, generator=g, dtype=dtype)  # noqa: E731
    q, k, v = make(heads).requires_grad_(), make(kv_heads).requires_grad_(), make(kv_heads)
    return q, k, v.requires_grad_(), make(heads)


@pytest.mark.parametrize(
    "config",
    [TreeAttentionConfig(), TreeAttentionConfig(16, 32), TreeAttentionConfig(7, 7)],
    ids=["one-tile", "chunked", "ragged-tiles"],
)
def test_output_and_gradients_equal_the_dense_mask(batch, config):
    """fp64, grouped-query heads: equal to SDPA with the dense tree mask to rounding."""
    rows, seq = batch.subtree_end.shape
    q, k, v, upstream = _inputs(rows, seq, torch.float64)
    got = tree_attention(q, k, v, batch.subtree_end, config=config)
    got_grads = torch.autograd.grad((got * upstream).sum(), (q, k, v))
    want = _dense(q, k, v, batch.subtree_end)
    want_grads = torch.autograd.grad((want * upstream).sum(), (q, k, v))
    assert (got - want).abs().max() < 1e-12
    for a, b in zip(got_grads, want_grads, strict=True):
        assert (a - b).abs().max() < 1e-12


def test_bf16_inputs_keep_their_dtype_and_match_fp32(batch):
    rows, seq = batch.subtree_end.shape
    q, k, v, _ = _inputs(rows, seq, torch.float32)
    got = tree_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), batch.subtree_end)
    assert got.dtype == torch.bfloat16
    assert (got.float() - _dense(q, k, v, batch.subtree_end)).abs().max() < 5e-2


def test_the_plan_keeps_exactly_the_tiles_the_mask_touches(batch):
    """Block classification from subtree_end alone equals the dense mask's non-empty tiles."""
    block = 16
    plan = plan_tree_attention(batch.subtree_end, block)
    mask = tree_attention_mask(batch.subtree_end)
    rows, seq = batch.subtree_end.shape
    blocks = -(-seq // block)
    padded = torch.zeros(rows, blocks * block, blocks * block, dtype=torch.bool)
    padded[:, :seq, :seq] = mask
    touched = padded.view(rows, blocks, block, blocks, block).any(-1).any(2)
    for r in range(rows):
        for qb in range(blocks):
            assert plan.key_blocks[r][qb].tolist() == touched[r, qb].nonzero().flatten().tolist()
    assert plan.visible_tiles == int(touched.sum()) < plan.total_tiles


@pytest.mark.parametrize(
    ("subtree_end", "match"),
    [
        (torch.tensor([[1, 2, 2]]), r"subtree_end\[0, 2\] = 2 is outside \[3, 3\]"),
        (torch.tensor([[4, 3, 3]]), r"subtree_end\[0, 0\] = 4 is outside \[1, 3\]"),
        (torch.tensor([[1.0, 2.0, 3.0]]), "must be an integer"),
        (torch.tensor([1, 2, 3]), "must be an integer"),
    ],
)
def test_a_malformed_subtree_end_is_refused(subtree_end, match):
    with pytest.raises(ValueError, match=match):
        plan_tree_attention(subtree_end)


def test_mismatched_shapes_are_refused(batch):
    rows, seq = batch.subtree_end.shape
    q, k, v, _ = _inputs(rows, seq, torch.float32)
    with pytest.raises(ValueError, match=r"subtree_end has shape \(3, 299\)"):
        tree_attention(q, k, v, batch.subtree_end[:, 1:])
    with pytest.raises(ValueError, match="not a multiple of 3 kv heads"):
        tree_attention(q, *_inputs(rows, seq, torch.float32, kv_heads=3)[1:3], batch.subtree_end)


def test_predecessor_logprobs_read_the_logits_at_the_predecessor(batch):
    logits = torch.randn(*batch.tokens.shape, VOCAB, dtype=torch.float64, requires_grad=True)
    got = predecessor_logprobs(logits, batch.tokens, batch.predecessor, batch.assistant_mask)
    full = logits.log_softmax(-1)
    mask = batch.assistant_mask
    for row in range(batch.tokens.shape[0]):
        cols = mask[row].nonzero().flatten()
        source = batch.predecessor[row, cols].long()
        want = full[row, source, batch.tokens[row, cols]]
        assert torch.equal(got[row, cols], want)
    assert torch.count_nonzero(got[~mask]) == 0
    assert (source != cols - 1).any(), "the batch must hold a branch (predecessor != i - 1)"
    got.sum().backward()
    assert logits.grad.abs().sum() > 0


def test_predecessor_logprobs_refuse_a_position_nothing_predicts(batch):
    mask = batch.assistant_mask.clone()
    mask[1, -1] = True  # the row ends in padding: predecessor -1
    logits = torch.zeros(*batch.tokens.shape, VOCAB)
    with pytest.raises(ValueError, match=r"position \(1, 299\) is masked but has predecessor -1"):
        predecessor_logprobs(logits, batch.tokens, batch.predecessor, mask)
