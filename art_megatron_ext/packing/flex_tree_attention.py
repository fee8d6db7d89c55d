"""Tree attention on a GPU: PyTorch FlexAttention with a `BlockMask` built from the `TreePlan`.

Why: the tiled kernel in `tree_attention.py` is plain PyTorch, loops in Python over rows x
query blocks x key chunks and upcasts every tile to fp32. It is correct on any device and is
the CPU path and the oracle, but on a GPU a fused kernel is far faster. FlexAttention compiles
one: it takes the visibility rule as a `mask_mod` and the tiles to visit as a `BlockMask`.

The `BlockMask` comes from the same plan as the tiled kernel, in O(S / block) per row: query
block `qb` visits exactly the key blocks `plan.key_blocks[row][qb]` (`BlockMask.from_kv_blocks`),
and the element rule inside a visited tile is the packing rule (`attention.py`): query `i` sees
key `j` iff `j <= i < subtree_end[j]`. `create_block_mask` is not used: it evaluates the
`mask_mod` over all S x S pairs. Every visited tile is treated as partial (the `mask_mod`
runs in it); nothing of size S x S is built.

Where it runs: CUDA, compiled (`torch.compile(flex_attention)`, once per process), in the
inputs' dtype (bf16 in training) with fp32 softmax inside the kernel. On CPU, FlexAttention's
forward runs eagerly but its backward does not (torch 2.14: `NotImplementedError`), so
`tree_attention_backend` picks the tiled kernel there; the CPU tests compare this path's
forward with the tiled kernel's, and the GPU check (`bench/gpu_check.sh`) compares forward
and backward, and times both against dense SDPA with the tree mask and against the tiled kernel
(`bench/gpu_check_flex_attention.py`; no GPU has run it yet).
"""

from __future__ import annotations

import functools

import torch

from art_megatron_ext.packing.tree_attention import BACKENDS, TreePlan


def tree_block_mask(subtree_end: torch.Tensor, plan: TreePlan, device=None):
    """The `BlockMask` of `plan` (rows of `subtree_end` `[rows, seq]`), on `device`."""
    from torch.nn.attention.flex_attention import BlockMask

    device = torch.device(device or subtree_end.device)
    rows = len(plan.key_blocks)
    q_blocks = len(plan.key_blocks[0]) if rows else 0
    counts = torch.zeros(rows, 1, q_blocks, dtype=torch.int32)
    indices = torch.zeros(rows, 1, q_blocks, q_blocks, dtype=torch.int32)
    for r, per_query_block in enumerate(plan.key_blocks):
        for qb, key_blocks in enumerate(per_query_block):
            counts[r, 0, qb] = len(key_blocks)
            indices[r, 0, qb, : len(key_blocks)] = key_blocks.to(torch.int32)
    ends = subtree_end.to(device, torch.int64)

    def visible(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < ends[b, kv_idx])

    return BlockMask.from_kv_blocks(
        counts.to(device),
        indices.to(device),
        BLOCK_SIZE=plan.block,
        mask_mod=visible,
        seq_lengths=(plan.seq_len, plan.seq_len),
    )


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask,
    *,
    scale: float,
    compiled: bool | None = None,
) -> torch.Tensor:
    """q `[rows, heads, seq, dim]`, k and v `[rows, kv_heads, seq, dim]` -> like q, through
    FlexAttention with `block_mask` (`tree_block_mask`). Grouped-query heads are handled by
    FlexAttention (`enable_gqa`). `compiled`: default on CUDA; eager elsewhere (forward only:
    FlexAttention has no CPU backward)."""
    from torch.nn.attention.flex_attention import flex_attention

    if compiled is None:
        compiled = q.is_cuda
    fn = _compiled_flex() if compiled else flex_attention
    return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def tree_attention_backend(requested: str, device: torch.device) -> str:
    """ "flex" or "tiled" for `requested` on `device`. "auto": flex on CUDA, tiled elsewhere.
    "flex" where it cannot train (not CUDA) is refused, never swapped for the tiled kernel."""
    if requested not in BACKENDS:
        raise ValueError(f"tree attention backend {requested!r}: expected one of {BACKENDS}")
    if requested == "auto":
        return "flex" if device.type == "cuda" else "tiled"
    if requested == "flex" and device.type != "cuda":
        raise ValueError(
            f"tree attention backend 'flex' needs a CUDA device, got {device}: FlexAttention "
            "has no backward on CPU (torch 2.14). Use backend 'auto' or 'tiled'."
        )
    return requested
