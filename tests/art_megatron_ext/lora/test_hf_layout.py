"""Megatron's fused QKV and FC1 layouts, checked against Megatron's own attention and MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from art_megatron_ext.lora.attach import describe_linear
from art_megatron_ext.lora.hf_layout import fuse_b_shard, split_fused_b
from art_megatron_ext.lora.tiny_gpt import build_gpt


def test_fused_qkv_layout_matches_megatron_attention(megatron_world, tiny_shape):
    """fuse_b_shard puts HF q/k/v rows where Megatron's attention reads q, k and v."""
    torch.manual_seed(0)
    model = build_gpt(tiny_shape)
    attn = model.decoder.layers[0].self_attention
    info = describe_linear("decoder.layers.0.self_attention.linear_qkv", attn.linear_qkv, {})
    s = tiny_shape
    q = torch.randn(s.num_attention_heads * s.head_dim, s.hidden_size)
    k = torch.randn(s.num_key_value_heads * s.head_dim, s.hidden_size)
    v = torch.randn(s.num_key_value_heads * s.head_dim, s.hidden_size)
    with torch.no_grad():
        attn.linear_qkv.weight.copy_(fuse_b_shard(info, [q, k, v], 0, 1))
    x = torch.randn(5, 1, s.hidden_size)
    query, key, value = attn.get_query_key_value_tensors(x, None)[:3]
    torch.testing.assert_close(query.reshape(5, 1, -1), x @ q.T, rtol=0, atol=1e-5)
    torch.testing.assert_close(key.reshape(5, 1, -1), x @ k.T, rtol=0, atol=1e-5)
    torch.testing.assert_close(value.reshape(5, 1, -1), x @ v.T, rtol=0, atol=1e-5)
    # and the split is the exact inverse
    for got, want in zip(split_fused_b(info, [attn.linear_qkv.weight]), [q, k, v], strict=True):
        assert torch.equal(got, want)


def test_fused_gate_up_layout_matches_megatron_mlp(megatron_world, tiny_shape):
    """FC1 holds [gate; up]: Megatron's MLP computes down(silu(gate x) * up x)."""
    torch.manual_seed(0)
    model = build_gpt(tiny_shape)
    mlp = model.decoder.layers[0].mlp
    info = describe_linear("decoder.layers.0.mlp.linear_fc1", mlp.linear_fc1, {})
    s = tiny_shape
    gate = torch.randn(s.intermediate_size, s.hidden_size) / 10
    up = torch.randn(s.intermediate_size, s.hidden_size) / 10
    with torch.no_grad():
        mlp.linear_fc1.weight.copy_(fuse_b_shard(info, [gate, up], 0, 1))
    x = torch.randn(5, 1, s.hidden_size)
    out, _ = mlp(x)
    want = (F.silu(x @ gate.T) * (x @ up.T)) @ mlp.linear_fc2.weight.T
    torch.testing.assert_close(out, want, rtol=0, atol=1e-5)


def test_split_and_fuse_are_inverse_across_tensor_parallel_shards():
    """Per-rank fused shards (TP=2) split into full HF tensors and back, bit for bit."""
    from types import SimpleNamespace

    qkv = SimpleNamespace(target="linear_qkv", gated=False, qkv_layout=(4, 2, 3))
    fc1 = SimpleNamespace(target="linear_fc1", gated=True, qkv_layout=None)
    q, k, v = torch.randn(24, 5), torch.randn(12, 5), torch.randn(12, 5)
    gate, up = torch.randn(8, 5), torch.randn(8, 5)
    for info, parts in ((qkv, [q, k, v]), (fc1, [gate, up])):
        shards = [fuse_b_shard(info, parts, r, 2) for r in range(2)]
        for got, want in zip(split_fused_b(info, shards), parts, strict=True):
            assert torch.equal(got, want)
    # rank 0 of TP=2 holds whole query groups 0-1 and the gate/up halves of its columns
    assert torch.equal(fuse_b_shard(qkv, [q, k, v], 0, 2)[:6], q[:6])
    assert torch.equal(fuse_b_shard(fc1, [gate, up], 1, 2), torch.cat([gate[4:], up[4:]]))
