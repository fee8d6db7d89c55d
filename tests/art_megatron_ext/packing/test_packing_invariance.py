"""Packing invariance: per-token logprobs from the packed rows, with the derived attention
mask, positions and predecessors, equal the logprobs of each trajectory run alone (fp32).

The oracle is a tiny causal transformer (learned positions, multi-head attention with an
explicit boolean mask, MLP): run alone, a trajectory sees a plain causal mask and positions
0..n-1; packed, it sees `tree_attention_mask(subtree_end)` and `input_pos`, and token t's
logprob is read from the logits at `predecessor[t]`.
"""

import numpy as np
import pytest
import torch
from torch import nn

from art_megatron_ext.packing import (
    PackingConfig,
    TrajectoryGroup,
    pack_groups,
    tree_attention_mask,
)

from .builders import VOCAB


class TinyCausalLM(nn.Module):
    def __init__(self, vocab=VOCAB, dim=32, heads=4, layers=2, max_positions=128):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(max_positions, dim)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "norm1": nn.LayerNorm(dim),
                    "qkv": nn.Linear(dim, 3 * dim),
                    "proj": nn.Linear(dim, dim),
                    "norm2": nn.LayerNorm(dim),
                    "mlp": nn.Sequential(
                        nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)
                    ),
                }
            )
            for _ in range(layers)
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, positions, allowed):
        """tokens, positions: [B, S]; allowed: [B, S, S] bool (query, key)."""
        x = self.embed(tokens) + self.positions(positions)
        batch, seq, dim = x.shape
        for block in self.blocks:
            q, k, v = block["qkv"](block["norm1"](x)).chunk(3, dim=-1)
            q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
            attended = nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed[:, None]
            )
            x = x + block["proj"](attended.transpose(1, 2).reshape(batch, seq, dim))
            x = x + block["mlp"](block["norm2"](x))
        return torch.log_softmax(self.head(x), dim=-1)


def _alone_logprobs(model, tokens):
    n = len(tokens)
    ids = torch.as_tensor(tokens)[None]
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None]
    logp = model(ids, torch.arange(n)[None], causal)[0]
    return logp[torch.arange(n - 1), ids[0, 1:]]


def _packed_logprobs(model, packed):
    logp = model(packed.tokens, packed.input_pos, tree_attention_mask(packed.subtree_end))
    return logp


def _assert_invariant(groups, seq_len):
    torch.manual_seed(0)
    model = TinyCausalLM().eval()
    packed = pack_groups(groups, PackingConfig(seq_len=seq_len, vocab_size=VOCAB))
    with torch.no_grad():
        logp = _packed_logprobs(model, packed)
        flat = [t for g in groups for t in g.trajectories]
        for k, trajectory in enumerate(flat):
            row, positions = packed.trajectory_positions[k]
            later = torch.as_tensor(positions[1:])
            predecessors = packed.predecessor[row, later].long()
            got = logp[row, predecessors, packed.tokens[row, later]]
            expected = _alone_logprobs(model, trajectory.tokens)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    return packed


def test_single_turn_groups(single_turn_group):
    rng = np.random.default_rng(0)
    groups = [single_turn_group(rng, prompt_len=8, completion_lens=(5, 9, 3, 7)) for _ in range(3)]
    packed = _assert_invariant(groups, seq_len=48)
    assert packed.stats.physical_tokens < packed.stats.logical_tokens


def test_multi_turn_histories(multi_turn_group):
    rng = np.random.default_rng(1)
    groups = [multi_turn_group(rng, turns=4) for _ in range(3)]
    packed = _assert_invariant(groups, seq_len=64)
    assert packed.stats.physical_tokens < packed.stats.logical_tokens


@pytest.mark.parametrize("seq_len", [96, 30])  # 30 splits groups across rows
def test_mixed_batch(seq_len, single_turn_group, multi_turn_group):
    rng = np.random.default_rng(2)
    groups = [
        multi_turn_group(rng, turns=3),
        single_turn_group(rng, prompt_len=6, completion_lens=(4, 10, 2)),
        single_turn_group(rng, prompt_len=3, completion_lens=(12,)),
        multi_turn_group(rng, turns=2),
        TrajectoryGroup(list(single_turn_group(rng, prompt_len=5).trajectories) * 2),
    ]
    _assert_invariant(groups, seq_len=seq_len)


def test_a_wrong_mask_is_detected(single_turn_group):
    """The oracle has teeth: plain causal attention over the packed row breaks invariance."""
    rng = np.random.default_rng(3)
    groups = [single_turn_group(rng, prompt_len=8, completion_lens=(5, 9))]
    torch.manual_seed(0)
    model = TinyCausalLM().eval()
    packed = pack_groups(groups, PackingConfig(seq_len=32, vocab_size=VOCAB))
    causal = torch.ones(32, 32, dtype=torch.bool).tril()[None]
    with torch.no_grad():
        logp = model(packed.tokens, packed.input_pos, causal)
        row, positions = packed.trajectory_positions[1]  # its branch follows the first's
        later = torch.as_tensor(positions[1:])
        got = logp[row, packed.predecessor[row, later].long(), packed.tokens[row, later]]
        expected = _alone_logprobs(model, groups[0].trajectories[1].tokens)
    assert not torch.allclose(got, expected, atol=1e-3)
