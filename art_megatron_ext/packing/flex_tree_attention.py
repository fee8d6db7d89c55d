"""Tree attention on a GPU: PyTorch FlexAttention with a `BlockMask` built from the `TreePlan`.

Why: the tiled kernel in `tree_attention.py` is plain PyTorch, loops in Python over rows x
query blocks x key chunks and upcasts every tile to fp32. It is correct on any device and is
the CPU path and the oracle, but on a GPU a fused kernel is far faster. FlexAttention compiles
one: it takes the visibility rule as a `mask_mod` and the tiles to visit as a `BlockMask`.

The `BlockMask` comes from the same plan as the tiled kernel, in O(S / block) per row: query
block `qb` visits exactly the key blocks `plan.key_blocks[row][qb]` (`BlockMask.from_kv_blocks`),
and the element rule inside a visited tile is the packing rule (`attention.py`): query `i` sees
key `j` iff `j <= i < subtree_end[j]`. `create_block_mask` is not used: it evaluates the
`mask_mod` over all S x S pairs. A visited tile whose every pair is visible (its key block lies
wholly before the query block and every key's subtree outlives the block's last query) is
passed as a full block, so the kernel skips the `mask_mod` there; the others are partial.
Nothing of size S x S is built.

Why fixed-size calls: the kernel is compiled with static shapes (`dynamic=False`), and the
packer makes a different number of rows each step. Each new row count used to be a new
compile, and past Dynamo's recompile limit (8) FlexAttention silently ran eagerly, with full
S x S scores (out of memory at 8k-32k tokens). So every call holds exactly `rows_per_call` rows
(`TreeAttentionConfig.flex_rows`): a batch is cut into calls of that many rows and the last is
padded with rows in which each token sees only itself (zero inputs, a few diagonal tiles of
work, dropped from the output). The inputs of every call are contiguous `[rows_per_call, ...]`
tensors (a copy of Megatron's `[s, b, h, d]` views), so the shape and the strides are the same
every step and the kernel compiles once per sequence length, dtype and grad mode. Rows never
interact, so the result of a row does not depend on how it was grouped: exact. Marking the row
dimension dynamic was the other way; it was not taken because it changes the compiled kernel
(symbolic sizes and strides) and could not be checked here: torch 2.14's CPU FlexAttention
lowering does not compile with a dynamic batch (C++ error, `cur_qSplitSize8` undeclared).

Block size: FlexAttention's kernels walk a block in tiles of 16 to 128 and need the tile to
divide the block; torch shrinks its tiles to a power-of-two block, so a block must be a power
of two >= 16 or a multiple of 128 (`check_flex_block`), checked before anything compiles.

Where it runs: CUDA, compiled (`torch.compile(flex_attention)`, once per process), in the
inputs' dtype (bf16 in training) with fp32 softmax inside the kernel. On CPU, FlexAttention's
forward runs (eagerly or compiled) but its backward does not (torch 2.14:
`NotImplementedError`), so `tree_attention_backend` picks the tiled kernel there; the CPU tests
compare this path's forward with the tiled kernel's and count compiles, and the GPU check
(`bench/gpu_check.sh`) compares forward and backward, and times both against dense SDPA with
the tree mask and against the tiled kernel (`bench/gpu_check_flex_attention.py`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from art_megatron_ext.packing.tree_attention import BACKENDS, TreePlan, plan_tree_attention


def check_flex_block(block: int) -> None:
    """Refuse a block FlexAttention's kernels cannot tile (see the module docstring)."""
    power_of_two = block >= 16 and block & (block - 1) == 0
    if not (power_of_two or (block > 0 and block % 128 == 0)):
        raise ValueError(
            f"TreeAttentionConfig.block={block} cannot be FlexAttention's block size: its "
            "kernel tiles (16 to 128 wide) must divide the block, so use a power of two >= 16 "
            "or a multiple of 128 (default 128)"
        )


@dataclass(frozen=True)
class FlexTreeMask:
    """The tree's `BlockMask`s, one per FlexAttention call of exactly `rows_per_call` rows.

    `rows`: rows of the batch; `block_masks[c]` covers rows `c * rows_per_call` onwards, the
    last one padded with self-only rows up to `rows_per_call`."""

    rows: int
    rows_per_call: int
    block_masks: tuple


def _tile_sets(subtree_end: torch.Tensor, key_blocks: list[list[torch.Tensor]], block: int):
    """(partial, full) `[n, QB, KB]` booleans on the host: the plan's tiles, split by whether
    the `mask_mod` has anything to mask in them."""
    n, seq = subtree_end.shape
    blocks = -(-seq // block)
    needed = torch.zeros(n, blocks, blocks, dtype=torch.bool)
    for r, per_query_block in enumerate(key_blocks):
        for qb, ids in enumerate(per_query_block):
            needed[r, qb, ids] = True
    padded = torch.full((n, blocks * block), seq, dtype=torch.int64)
    padded[:, :seq] = subtree_end.to("cpu", torch.int64)
    lowest_end = padded.view(n, blocks, block).amin(-1)  # [n, KB]: the earliest subtree end
    ids = torch.arange(blocks)
    past_last_query = torch.clamp((ids + 1) * block, max=seq)  # [QB]
    full = (
        needed
        & (ids[None, None, :] < ids[None, :, None])
        & (lowest_end[:, None, :] >= past_last_query[None, :, None])
    )
    return needed & ~full, full


def _counts_and_indices(tiles: torch.Tensor):
    """`[n, QB, KB]` booleans -> (counts `[n, 1, QB]`, ascending indices `[n, 1, QB, KB]`)."""
    order = torch.sort((~tiles).to(torch.uint8), dim=-1, stable=True).indices
    counts = tiles.sum(-1, dtype=torch.int32)
    return counts[:, None], order.to(torch.int32)[:, None]


def _one_call_mask(subtree_end: torch.Tensor, key_blocks, seq: int, block: int, device):
    from torch.nn.attention.flex_attention import BlockMask

    partial, full = _tile_sets(subtree_end, key_blocks, block)
    (kv_num, kv_idx), (full_num, full_idx) = map(_counts_and_indices, (partial, full))
    ends = subtree_end.to(device, torch.int64)

    def visible(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < ends[b, kv_idx])

    return BlockMask.from_kv_blocks(
        kv_num.to(device),
        kv_idx.to(device),
        full_num.to(device),
        full_idx.to(device),
        BLOCK_SIZE=block,
        mask_mod=visible,
        seq_lengths=(seq, seq),
    )


def tree_block_mask(
    subtree_end: torch.Tensor, plan: TreePlan, device=None, *, rows_per_call: int = 1
) -> FlexTreeMask:
    """The `FlexTreeMask` of `plan` (rows of `subtree_end` `[rows, seq]`), on `device`, in
    calls of `rows_per_call` rows (`TreeAttentionConfig.flex_rows`)."""
    check_flex_block(plan.block)
    if rows_per_call < 1:
        raise ValueError(f"rows_per_call={rows_per_call}: need at least one row per call")
    device = torch.device(device or subtree_end.device)
    rows, seq = subtree_end.shape
    ends = subtree_end.to("cpu", torch.int64)
    key_blocks = list(plan.key_blocks)
    short = -rows % rows_per_call
    if short:  # self-only rows: each token sees itself, a few diagonal tiles
        pad = torch.arange(1, seq + 1).expand(short, seq)
        ends = torch.cat([ends, pad])
        key_blocks += plan_tree_attention(pad, plan.block).key_blocks
    masks = tuple(
        _one_call_mask(
            ends[lo : lo + rows_per_call], key_blocks[lo : lo + rows_per_call], seq, plan.block,
            device,
        )
        for lo in range(0, rows + short, rows_per_call)
    )  # fmt: skip
    return FlexTreeMask(rows, rows_per_call, masks)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _call_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x` as a contiguous `[rows, ...]` tensor (zero rows appended): one shape and one set
    of strides for every call."""
    if x.shape[0] == rows:
        return x.contiguous()
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


def flex_tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: FlexTreeMask,
    *,
    scale: float,
    compiled: bool | None = None,
) -> torch.Tensor:
    """q `[rows, heads, seq, dim]`, k and v `[rows, kv_heads, seq, dim]` -> like q, through
    FlexAttention with `mask` (`tree_block_mask`), one call per `mask.rows_per_call` rows.
    Grouped-query heads are handled by FlexAttention (`enable_gqa`). `compiled`: default on
    CUDA; eager elsewhere (forward only: FlexAttention has no CPU backward)."""
    from torch.nn.attention.flex_attention import flex_attention

    rows, per_call = q.shape[0], mask.rows_per_call
    if rows != mask.rows:
        raise ValueError(f"the mask is for {mask.rows} rows, the inputs have {rows}")
    if compiled is None:
        compiled = q.is_cuda
    fn = _compiled_flex() if compiled else flex_attention
    gqa = k.shape[1] != q.shape[1]
    outs = []
    for call, block_mask in enumerate(mask.block_masks):
        lo = call * per_call
        n = min(rows, lo + per_call) - lo
        inputs = [_call_rows(x[lo : lo + n], per_call) for x in (q, k, v)]
        out = fn(*inputs, block_mask=block_mask, scale=scale, enable_gqa=gqa)
        outs.append(out[:n])
    return outs[0] if len(outs) == 1 else torch.cat(outs)


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
