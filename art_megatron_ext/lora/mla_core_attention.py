"""A TE-style core attention for multi-latent attention (MLA) on the local (no-TE) spec.

Why: Megatron's local `DotProductAttention` has no `k_channels` / `v_channels`, and MLA's
q/k head (nope + rope) differs from its v head, so a local-spec MLA model does not build
("unexpected keyword argument 'k_channels'"; fix 2 in docs/model-mapping.md).
`TEDotProductAttention` has them; this takes TE's constructor arguments and computes
softmax(q k^T * scale + mask) v with torch, in fp32. `deepseek_gpt.build_deepseek_gpt` sets it
as `core_attention` in every layer spec (and `bench/bridge_eval/run_bridge.py --fix`).
Packed sequences and attention biases are refused (`NotImplementedError`).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule


class SdpaCoreAttention(MegatronModule):
    """softmax(q k^T * softmax_scale + mask) v with TE's constructor arguments."""

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type=None,
        softmax_scale=None,
        k_channels=None,
        v_channels=None,
        cp_comm_type=None,
        pg_collection=None,
        **_,
    ):
        super().__init__(config=config)
        self.softmax_scale = softmax_scale
        self.k_channels = k_channels
        self.v_channels = v_channels
        self.hidden_size_per_attention_head_v = v_channels

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
        **_,
    ):
        """[s, b, n, h] query/key/value -> [s, b, n * hv]; `attention_mask` True = masked."""
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SdpaCoreAttention: no packed sequences, no bias")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, h]
        if k.shape[1] != q.shape[1]:  # grouped-query attention
            rep = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(rep, 1)
            v = v.repeat_interleave(rep, 1)
        scale = self.softmax_scale if self.softmax_scale is not None else q.shape[-1] ** -0.5
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        if attention_mask is None:  # causal
            s = scores.shape[-1]
            attention_mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=q.device), 1)
        scores = scores.masked_fill(attention_mask, float("-inf"))
        out = torch.matmul(scores.softmax(-1), v.float()).to(query.dtype)  # [b, n, s, hv]
        b, n, s, hv = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, n * hv)
