"""Preprocessing: from the all-gathered routing map to the dispatch layout (pure functions).

Why pure tensor functions: they *are* the specification the CUDA scan kernel reproduces bit
for bit, they run on any device, and none of them reads a value back to the host (no
`.item()`, no data-dependent shapes), so the static-budget path stays free of device-to-host
synchronization; a test runs them on the `meta` device to prove it.

Notation: W ranks, T tokens per rank, L experts per rank, E = W*L. A *slot* is a
(source rank, token) pair, flattened as `source * T + token`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class ExpertLayout(NamedTuple):
    """Where each (slot, local expert) pair lands in the expert-major permuted output."""

    positions: torch.Tensor  # int64 [S, L]: output row, or -1 (not routed / dropped)
    tokens_per_expert: torch.Tensor  # int64 [L]: padded block sizes (clamped to the budget)
    overflow_flag: torch.Tensor  # int32 [1]: 1 when a routed pair was dropped over the budget


def rank_need(global_map: torch.Tensor, num_experts_per_rank: int) -> torch.Tensor:
    """bool [W, T, W]: does token t of source s use any expert of destination d."""
    world, tokens, experts = global_map.shape
    # explicit sizes: with T = 0 a -1 dimension would be ambiguous
    per_rank = num_experts_per_rank
    return global_map.view(world, tokens, experts // per_rank, per_rank).any(-1)


def local_expert_map(global_map: torch.Tensor, rank: int, num_experts_per_rank: int):
    """bool [W*T, L]: the routing bits of this rank's experts for every slot."""
    lo = rank * num_experts_per_rank
    world, tokens, _ = global_map.shape
    return global_map[:, :, lo : lo + num_experts_per_rank].reshape(
        world * tokens, num_experts_per_rank
    )


def expert_positions(
    local_map: torch.Tensor, pad_multiple: int, budget: int | None
) -> ExpertLayout:
    """Expert-major layout: expert e's rows in slot order, each block padded to `pad_multiple`.

    Block e starts at the sum of the padded sizes of experts 0..e-1. With a `budget` (M rows)
    blocks are clamped in expert order: pairs whose row would be >= M are dropped (-1) and
    the overflow flag is set; `tokens_per_expert` then counts the rows left inside M.
    """
    routed = local_map.to(torch.int64)
    counts = routed.sum(0)
    padded = (counts + (pad_multiple - 1)) // pad_multiple * pad_multiple
    starts = torch.cumsum(padded, 0) - padded
    rank_in_expert = torch.cumsum(routed, 0) - routed
    positions = starts.unsqueeze(0) + rank_in_expert
    if budget is None:
        overflow = torch.zeros(1, dtype=torch.int32, device=local_map.device)
        kept = local_map
        tokens_per_expert = padded
    else:
        kept = local_map & (positions < budget)
        overflow = (local_map & ~kept).any().to(torch.int32).reshape(1)
        tokens_per_expert = torch.minimum(padded, (budget - starts).clamp_min(0))
    positions = torch.where(kept, positions, torch.full_like(positions, -1))
    return ExpertLayout(positions, tokens_per_expert, overflow)


def sparse_to_dense_slots(need_own: torch.Tensor, rank: int) -> torch.Tensor:
    """int32 [T, W], static-budget layout: an own token's row at every peer is its slot."""
    tokens = need_own.shape[0]
    slot = rank * tokens + torch.arange(tokens, device=need_own.device).unsqueeze(1)
    return torch.where(need_own, slot, torch.full_like(slot, -1)).to(torch.int32)


def sparse_to_dense_compact(need: torch.Tensor, rank: int) -> torch.Tensor:
    """int32 [T, W], blocking layout: rows are compact, ordered by source rank then token.

    An own token's row at peer d is the number of slots before it (in slot order) that
    also use one of d's experts.
    """
    world, tokens, _ = need.shape
    flat = need.reshape(world * tokens, world).to(torch.int64)
    before = (torch.cumsum(flat, 0) - flat).view(world, tokens, world)[rank]
    return torch.where(need[rank], before, torch.full_like(before, -1)).to(torch.int32)
