"""The static-budget reference pipeline on one device (test_layout's meta check and its GPU
twin): layout, permute, unpermute, reduction and combine of hybridep.layout/movement, with
no step that needs a value on the host."""

from __future__ import annotations

import torch

from hybridep import layout, movement


def static_pipeline(device: str) -> torch.Tensor:
    world, tokens, experts_per_rank, hidden = 2, 5, 3, 4
    global_map = torch.zeros(world, tokens, world * experts_per_rank, dtype=torch.bool).to(device)
    need = layout.rank_need(global_map, experts_per_rank)
    local_map = layout.local_expert_map(global_map, 0, experts_per_rank)
    lay = layout.expert_positions(local_map, 4, 16)
    layout.sparse_to_dense_slots(need[0], 0)
    recv = torch.zeros(world * tokens, hidden, device=device)
    recv_probs = torch.zeros(world * tokens, experts_per_rank, device=device)
    permuted, probs = movement.permute_tokens(recv, recv_probs, lay.positions, 16)
    rows, _ = movement.unpermute_tokens(permuted, probs, lay.positions)
    out = movement.reduce_over_ranks(rows.view(world, tokens, hidden), need[0])
    movement.scatter_probs_over_ranks(recv_probs.view(world, tokens, -1), need[0])
    rank_of_row = torch.arange(world, device=device).repeat_interleave(tokens)
    token_of_row = torch.where(
        need[0].t().reshape(-1), torch.arange(tokens, device=device).repeat(world), -1
    )
    movement.combine_rows(rows, recv_probs, rank_of_row, token_of_row, world, tokens)
    return out
