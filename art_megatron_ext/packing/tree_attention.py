"""Attention over packed prefix-tree rows without an S x S mask or S x S scores.

The rule (see `attention.py`): rows are in depth-first preorder, so query `i` may see key `j`
iff `j <= i < subtree_end[j]`. A `[S, S]` mask is 1 GiB per 32k row before any scores; this
module reads `subtree_end` directly.

Block structure, exact and O(S / block): every key `j` of key block `kb` is visible to the
queries `[j, subtree_end[j])`, an interval that starts inside `kb`. So key block `kb` is
visible to exactly the query blocks `kb .. (max_{j in kb} subtree_end[j] - 1) // block`, and
every other (query block, key block) pair is empty and skipped. `TreePlan` keeps, per query
block, the list of key blocks it needs; inside a tile the element mask is rebuilt from
`subtree_end` (`block x keys`, never `S x S`).

Why our own blockwise kernel instead of PyTorch FlexAttention (measured here, torch 2.14.1,
November 2026): `flex_attention` raises `NotImplementedError: FlexAttention does not support
backward on CPU` both eager and under `torch.compile` (gcc is present), so on the CPU machines
that run our tests and CPU trainers it cannot train at all; eager flex also materialises the
scores, and `create_block_mask` evaluates the `mask_mod` over all `S x S` pairs. The kernel
below is plain PyTorch (matmuls on `[heads, block, keys]` tiles), runs on any device, and
follows flash attention: the forward keeps an online softmax over key chunks and saves only
the output and the log-sum-exp per query; the backward recomputes each tile from them. Neither
pass stores anything of size S x S; the largest temporary is `heads x block x chunk`.
Fully masked key blocks are never touched. On a GPU the fused path is FlexAttention with a
`BlockMask` built from the same plan (`flex_tree_attention.py`); this kernel stays the CPU
path and the oracle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: Which kernel runs tree attention: "auto" (FlexAttention on CUDA, this module's tiled kernel
#: elsewhere), "flex" (CUDA only: `flex_tree_attention.py`), "tiled" (this module).
BACKENDS = ("auto", "flex", "tiled")


@dataclass(frozen=True)
class TreeAttentionConfig:
    """Tile sizes and backend. `block`: query and key block length of the plan (the skip
    granularity; FlexAttention's block size too, where it must be a power of two >= 16 or a
    multiple of 128). `chunk_keys`: most keys one tile of the tiled kernel holds (bounds the
    `heads x block x chunk_keys` scores). `backend`: one of `BACKENDS`. `flex_rows`: rows per
    FlexAttention call; every call has exactly this many (a batch is split, the last call
    padded) so the compiled kernel sees one shape whatever the packer makes: set it to the
    rows of a micro-batch (`flex_tree_attention.py`)."""

    block: int = 128
    chunk_keys: int = 2048
    backend: str = "auto"
    flex_rows: int = 1

    def __post_init__(self) -> None:
        if self.block < 1 or self.chunk_keys < self.block:
            raise ValueError(f"need block >= 1 and chunk_keys >= block, got {self}")
        if self.backend not in BACKENDS:
            raise ValueError(f"tree attention backend {self.backend!r}: expected one of {BACKENDS}")
        if self.flex_rows < 1:
            raise ValueError(f"TreeAttentionConfig.flex_rows={self.flex_rows}: need >= 1")


@dataclass(frozen=True)
class TreePlan:
    """Which key blocks each query block needs, for each row.

    `key_blocks[row][qb]` is an int64 tensor of key-block ids (ascending, ending with `qb`).
    `visible_keys` counts the (query block, key block) tiles kept, `total_tiles` the causal
    ones a dense causal kernel would visit (for benchmarks)."""

    seq_len: int
    block: int
    key_blocks: list[list[torch.Tensor]]
    visible_tiles: int
    total_tiles: int


def _check_subtree_end(subtree_end: torch.Tensor) -> None:
    if subtree_end.dim() != 2 or subtree_end.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"subtree_end must be an integer [rows, seq] tensor, got {subtree_end.dtype} "
            f"{tuple(subtree_end.shape)}"
        )
    seq = subtree_end.shape[1]
    position = torch.arange(seq, device=subtree_end.device)
    bad = (subtree_end <= position) | (subtree_end > seq)
    if bool(bad.any()):
        row, col = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"subtree_end[{row}, {col}] = {int(subtree_end[row, col])} is outside "
            f"[{col + 1}, {seq}] (every token's subtree holds itself and ends in the row)"
        )


def plan_tree_attention(subtree_end: torch.Tensor, block: int = 128) -> TreePlan:
    """Build the block plan of `[rows, seq]` `subtree_end` (see the module docstring)."""
    _check_subtree_end(subtree_end)
    rows, seq = subtree_end.shape
    blocks = -(-seq // block)
    padded = torch.full((rows, blocks * block), 0, dtype=torch.int64)
    padded[:, :seq] = subtree_end.to("cpu", torch.int64)
    # last query block each key block reaches
    reach = (padded.view(rows, blocks, block).amax(-1) - 1) // block  # [rows, blocks]
    query_block = torch.arange(blocks)
    plans, visible = [], 0
    for r in range(rows):
        # needed[qb, kb]: kb <= qb <= reach[kb]; blocks x blocks booleans (S/block squared)
        needed = (query_block[None, :] <= query_block[:, None]) & (
            query_block[:, None] <= reach[r][None, :]
        )
        visible += int(needed.sum())
        plans.append([needed[qb].nonzero().flatten() for qb in range(blocks)])
    total = rows * blocks * (blocks + 1) // 2
    return TreePlan(seq, block, plans, visible, total)


def _tiles(plan: TreePlan, key_blocks: torch.Tensor, chunk_keys: int, device):
    """Split a query block's key blocks into chunks of at most `chunk_keys` key indices."""
    per_chunk = max(1, chunk_keys // plan.block)
    offsets = torch.arange(plan.block)
    for start in range(0, len(key_blocks), per_chunk):
        ids = key_blocks[start : start + per_chunk]
        keys = (ids[:, None] * plan.block + offsets).flatten()
        yield keys[keys < plan.seq_len].to(device)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax and accumulation precision: fp32, or the input's if wider (fp64 in checks)."""
    return torch.promote_types(dtype, torch.float32)


def _scores(q, k, keys, queries, subtree_end_row, scale):
    """Masked scores of one tile: q `[h, bq, d]`, k `[h, n, d]` -> `[h, bq, n]`."""
    acc = _acc_dtype(q.dtype)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    key_end = subtree_end_row[keys]
    allowed = (keys[None, :] <= queries[:, None]) & (queries[:, None] < key_end[None, :])
    return scores.masked_fill_(~allowed, float("-inf"))


class _TreeAttentionFunction(torch.autograd.Function):
    """q `[rows, heads, seq, dim]`, k and v `[rows, kv_heads, seq, dim]` -> out like q.

    Grouped-query heads are never repeated: a tile stacks the `group = heads / kv_heads`
    query heads that share a kv head along the query axis (`[kv_heads, group * block, dim]`),
    as Megatron's `repeat_interleave` pairs them (query head h reads kv head h // group)."""

    @staticmethod
    def forward(ctx, q, k, v, subtree_end, plan: TreePlan, scale: float, chunk_keys: int):
        rows, heads, seq, dim = q.shape
        kv_heads = k.shape[1]
        group = heads // kv_heads
        dev, acc_dtype = q.device, _acc_dtype(q.dtype)
        out = torch.empty_like(q)
        lse = torch.empty(rows, heads, seq, dtype=acc_dtype, device=dev)
        ends = subtree_end.to(q.device, torch.int64)
        for r in range(rows):
            for qb, key_blocks in enumerate(plan.key_blocks[r]):
                q0, q1 = qb * plan.block, min(seq, (qb + 1) * plan.block)
                rows_in_tile = group * (q1 - q0)
                queries = torch.arange(q0, q1, device=dev).repeat(group)
                qt = q[r, :, q0:q1].reshape(kv_heads, rows_in_tile, dim)
                best = torch.full(
                    (kv_heads, rows_in_tile, 1), -math.inf, dtype=acc_dtype, device=dev
                )
                total = torch.zeros(kv_heads, rows_in_tile, 1, dtype=acc_dtype, device=dev)
                acc = torch.zeros(kv_heads, rows_in_tile, dim, dtype=acc_dtype, device=dev)
                for keys in _tiles(plan, key_blocks, chunk_keys, dev):
                    scores = _scores(qt, k[r][:, keys], keys, queries, ends[r], scale)
                    new_best = torch.maximum(best, scores.amax(-1, keepdim=True))
                    # a query may see no key of this chunk yet (-inf): shift by 0 there
                    shift = new_best.masked_fill(new_best == -math.inf, 0.0)
                    rescale = torch.exp(best - shift)  # 0 where best was -inf
                    probs = torch.exp(scores - shift)
                    total = total * rescale + probs.sum(-1, keepdim=True)
                    acc = acc * rescale + torch.matmul(probs, v[r][:, keys].to(acc_dtype))
                    best = new_best
                # every query sees itself (subtree_end[i] > i): total > 0
                out[r, :, q0:q1] = (acc / total).reshape(heads, q1 - q0, dim).to(q.dtype)
                lse[r, :, q0:q1] = (best + torch.log(total)).reshape(heads, q1 - q0)
        ctx.save_for_backward(q, k, v, out, lse, ends)
        ctx.plan, ctx.scale, ctx.chunk_keys = plan, scale, chunk_keys
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, ends = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        rows, heads, seq, dim = q.shape
        kv_heads = k.shape[1]
        group = heads // kv_heads
        acc_dtype = _acc_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc_dtype, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc_dtype, device=q.device)
        grad_out = grad_out.to(acc_dtype)
        delta = (grad_out * out.to(acc_dtype)).sum(-1)  # [rows, heads, seq]
        for r in range(rows):
            for qb, key_blocks in enumerate(plan.key_blocks[r]):
                q0, q1 = qb * plan.block, min(seq, (qb + 1) * plan.block)
                shape = (kv_heads, group * (q1 - q0), -1)
                queries = torch.arange(q0, q1, device=q.device).repeat(group)
                qt, go = q[r, :, q0:q1].reshape(shape), grad_out[r, :, q0:q1].reshape(shape)
                row_lse, row_delta = (
                    lse[r, :, q0:q1].reshape(shape),
                    delta[r, :, q0:q1].reshape(shape),
                )
                for keys in _tiles(plan, key_blocks, ctx.chunk_keys, q.device):
                    kt, vt = k[r][:, keys].to(acc_dtype), v[r][:, keys].to(acc_dtype)
                    probs = torch.exp(_scores(qt, kt, keys, queries, ends[r], scale) - row_lse)
                    dv[r].index_add_(1, keys, torch.matmul(probs.transpose(-1, -2), go))
                    dscores = probs * (torch.matmul(go, vt.transpose(-1, -2)) - row_delta)
                    dq_tile = torch.matmul(dscores, kt) * scale
                    dq[r, :, q0:q1] += dq_tile.reshape(heads, q1 - q0, dim)
                    dk[r].index_add_(
                        1, keys, torch.matmul(dscores.transpose(-1, -2), qt.to(acc_dtype)) * scale
                    )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    subtree_end: torch.Tensor,
    *,
    scale: float | None = None,
    plan: TreePlan | None = None,
    config: TreeAttentionConfig | None = None,
) -> torch.Tensor:
    """Tree attention. q `[rows, heads, seq, dim]`, k and v `[rows, kv_heads, seq, dim]`
    (grouped-query: `heads` a multiple of `kv_heads`), `subtree_end` `[rows, seq]`.

    `plan`: a `plan_tree_attention(subtree_end, config.block)` to reuse across layers.
    Softmax runs in fp32; the output has q's dtype."""
    config = config or TreeAttentionConfig()
    rows, heads, seq, dim = q.shape
    if k.shape != v.shape or k.shape[0] != rows or k.shape[2] != seq or k.shape[3] != dim:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree")
    if subtree_end.shape != (rows, seq):
        raise ValueError(
            f"subtree_end has shape {tuple(subtree_end.shape)}, expected ({rows}, {seq})"
        )
    if heads % k.shape[1]:
        raise ValueError(f"{heads} query heads are not a multiple of {k.shape[1]} kv heads")
    if plan is None:
        plan = plan_tree_attention(subtree_end, config.block)
    elif plan.seq_len != seq or len(plan.key_blocks) != rows:
        raise ValueError(
            f"plan is for {len(plan.key_blocks)} x {plan.seq_len} rows, not {rows} x {seq}"
        )
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    return _TreeAttentionFunction.apply(q, k, v, subtree_end, plan, scale, config.chunk_keys)
