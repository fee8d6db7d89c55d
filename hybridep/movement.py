"""Data movement and reductions of the reference semantics (pure functions, no host sync).

Why here and not inside the torch backend: these functions define, bit for bit, what the
CUDA kernels must produce. Permute is pure data movement (padding and rows past the used
blocks are zero). Unpermute and the cross-rank reduction are *unweighted* sums (Megatron
applies the probs inside the expert MLP) accumulated in fp32 starting from +0.0, adding
terms in a fixed order (local experts in index order, then ranks in rank order) and
skipping terms that are not routed, then rounded once to the tensor's dtype.
"""

from __future__ import annotations

import torch


def _gather_rows_or_zero(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`src[index]` where index >= 0, zero rows where index == -1 (no data-dependent shape)."""
    if src.shape[0] == 0:
        return src.new_zeros((index.shape[0], *src.shape[1:]))
    rows = src.index_select(0, index.clamp(min=0))  # a fresh tensor: safe to fill in place
    return rows.masked_fill_((index < 0).view(-1, *([1] * (src.dim() - 1))), 0)


def _source_of_output_row(positions: torch.Tensor, num_rows: int) -> torch.Tensor:
    """int64 [M]: the flat (row * L + expert) index feeding each permuted row, or -1."""
    flat = positions.reshape(-1)
    target = torch.where(flat >= 0, flat, torch.full_like(flat, num_rows))  # M = dump slot
    source = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=positions.device)
    source.scatter_(0, target, torch.arange(flat.numel(), device=positions.device))
    return source[:num_rows]


def permute_tokens(
    recv_hidden: torch.Tensor,
    recv_probs: torch.Tensor | None,
    positions: torch.Tensor,
    num_permuted_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Receive rows -> expert-major `[M, H]` tokens and `[M]` fp32 probs; padding is zero."""
    num_experts = positions.shape[1]
    source = _source_of_output_row(positions, num_permuted_tokens)
    row = torch.where(source >= 0, source // num_experts, source)
    tokens = _gather_rows_or_zero(recv_hidden, row)
    if recv_probs is None:
        return tokens, None
    probs = _gather_rows_or_zero(recv_probs.reshape(-1), source)
    return tokens, probs


def unpermute_tokens(
    tokens: torch.Tensor, probs: torch.Tensor | None, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Expert-major `[M, H]` -> receive rows `[N, H]`, summing each row's local experts.

    The sum is fp32, over local experts in index order, then rounded to `tokens.dtype`.
    Probs (`[M]`, only in dispatch's backward) are gathered back to `[N, L]` (no sum).
    """
    num_rows, num_experts = positions.shape
    if tokens.device.type == "cpu":
        recv_hidden = _unpermute_sequential_index_add(tokens, positions)
    else:
        recv_hidden = _unpermute_by_expert(tokens, positions)
    if probs is None:
        return recv_hidden, None
    recv_probs = _gather_rows_or_zero(probs, positions.reshape(-1)).view(num_rows, num_experts)
    return recv_hidden, recv_probs


def _unpermute_by_expert(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One gather per local expert, accumulated in expert order (any device)."""
    num_rows, num_experts = positions.shape
    acc = torch.zeros((num_rows, tokens.shape[1]), dtype=torch.float32, device=tokens.device)
    for expert in range(num_experts):
        # Skipped terms are gathered as +0.0; acc (started at +0.0) is never -0.0, so adding
        # +0.0 leaves it bit-identical, which is the documented "skip" semantics.
        acc.add_(_gather_rows_or_zero(tokens, positions[:, expert]).to(torch.float32))
    return acc.to(tokens.dtype)


def _unpermute_sequential_index_add(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One pass over the permuted rows (CPU only): `index_add_` applies the rows in index
    order, and a row's experts sit in expert order in the expert-major layout, so each row
    is summed in the same order as `_unpermute_by_expert` (on CUDA `index_add_` uses atomics,
    whose order is not fixed, hence the per-expert path there)."""
    num_rows, num_experts = positions.shape
    source = _source_of_output_row(positions, tokens.shape[0])
    target = torch.where(source >= 0, source // num_experts, num_rows)  # padding -> dump row
    acc = torch.zeros((num_rows + 1, tokens.shape[1]), dtype=torch.float32, device=tokens.device)
    acc.index_add_(0, target, tokens.to(torch.float32))
    return acc[:num_rows].to(tokens.dtype)


def reduce_over_ranks(back: torch.Tensor, need_own: torch.Tensor) -> torch.Tensor:
    """`[W, T, H]` rows returned by each rank -> `[T, H]`: fp32 sum in rank order, rounded once."""
    world, tokens, hidden = back.shape
    acc = torch.zeros((tokens, hidden), dtype=torch.float32, device=back.device)
    for rank in range(world):
        skipped = ~need_own[:, rank].unsqueeze(1)
        acc.add_(back[rank].to(torch.float32).masked_fill(skipped, 0))  # +0.0: see unpermute
    return acc.to(back.dtype)


def scatter_probs_over_ranks(back_probs: torch.Tensor, need_own: torch.Tensor) -> torch.Tensor:
    """`[W, T, L]` prob rows returned by each rank -> `[T, W*L]` (rank slices are disjoint)."""
    world, tokens, experts = back_probs.shape
    probs = back_probs.transpose(0, 1)  # [T, W, L]
    zero = torch.zeros((), dtype=probs.dtype, device=probs.device)
    return torch.where(need_own.unsqueeze(2), probs, zero).reshape(tokens, world * experts)


def combine_rows(
    rows: torch.Tensor,
    probs: torch.Tensor | None,
    rank_of_row: torch.Tensor,
    token_of_row: torch.Tensor,
    world: int,
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows returned to this rank -> `[T, H]` sums and `[T, W*L]` prob slices.

    `rows [R, H]` are ordered by returning rank, then token; `token_of_row` is -1 for rows
    to skip. Same result as `reduce_over_ranks` / `scatter_probs_over_ranks` on the dense
    `[W, T, ...]` form: on CPU one sequential `index_add_` pass over the rows (it applies
    them in order, so each token's rows are summed in rank order), elsewhere the dense form.
    """
    skip = token_of_row < 0
    if rows.device.type == "cpu":
        acc = rows.new_zeros((num_tokens + 1, rows.shape[1]), dtype=torch.float32)
        acc.index_add_(0, torch.where(skip, num_tokens, token_of_row), rows.to(torch.float32))
        out = acc[:num_tokens].to(rows.dtype)
    else:
        out = _combine_rows_dense(rows, rank_of_row, token_of_row, world, num_tokens)
    if probs is None:
        return out, None
    slot = torch.where(skip, world * num_tokens, token_of_row * world + rank_of_row)
    scattered = probs.new_zeros((world * num_tokens + 1, probs.shape[1]))
    scattered.index_copy_(0, slot, probs)
    return out, scattered[:-1].view(num_tokens, world * probs.shape[1])  # T = 0: no -1


def _combine_rows_dense(
    rows: torch.Tensor,
    rank_of_row: torch.Tensor,
    token_of_row: torch.Tensor,
    world: int,
    num_tokens: int,
) -> torch.Tensor:
    """`combine_rows` through the dense `[W, T, H]` form (any device, deterministic)."""
    skip = token_of_row < 0
    dense_index = torch.where(skip, world * num_tokens, rank_of_row * num_tokens + token_of_row)
    dense = rows.new_zeros((world * num_tokens + 1, rows.shape[1]))
    dense.index_copy_(0, dense_index, rows)
    need = torch.zeros(world * num_tokens + 1, dtype=torch.bool, device=rows.device)
    need[dense_index] = True
    need_own = need[:-1].view(world, num_tokens).t()
    return reduce_over_ranks(dense[:-1].view(world, num_tokens, rows.shape[1]), need_own)
