"""The static-budget reference pipeline on one device (test_layout's meta check and its GPU
twin): layout, permute, unpermute, reduction and combine of hybridep.layout/movement, with
no step that needs a value on the host.

Inputs are built first, on the device (`static_inputs`), and the pipeline only computes
(`static_pipeline`): a test that forbids host synchronization (`set_sync_debug_mode("error")`
on a GPU) turns it on between the two, so copying the inputs over is not counted against the
path (the first GPU run failed in its set-up: a CPU tensor copied to the GPU after the mode
was on). Inside the pipeline nothing comes from the host: test_layout.py checks that on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridep import layout, movement

WORLD, TOKENS, EXPERTS_PER_RANK, HIDDEN = 2, 5, 3, 4


@dataclass(frozen=True)
class StaticInputs:
    global_map: torch.Tensor  # [W, T, W * L] bool
    recv: torch.Tensor  # [W * T, H] receive rows
    recv_probs: torch.Tensor  # [W * T, L]


def static_inputs(device: str) -> StaticInputs:
    """A random routing and receive rows, drawn on the host and moved to `device` once."""
    gen = torch.Generator().manual_seed(0)
    rows = WORLD * TOKENS
    global_map = torch.rand(WORLD, TOKENS, WORLD * EXPERTS_PER_RANK, generator=gen) < 0.4
    recv = torch.randint(-4, 5, (rows, HIDDEN), generator=gen).float()
    recv_probs = torch.rand(rows, EXPERTS_PER_RANK, generator=gen)
    return StaticInputs(*(t.to(device) for t in (global_map, recv, recv_probs)))


def static_pipeline(inputs: StaticInputs) -> torch.Tensor:
    """The static-budget path on `inputs`' device; returns the combined `[T, H]` rows."""
    world, tokens, experts_per_rank = WORLD, TOKENS, EXPERTS_PER_RANK
    global_map, recv, recv_probs = inputs.global_map, inputs.recv, inputs.recv_probs
    device = global_map.device
    need = layout.rank_need(global_map, experts_per_rank)
    local_map = layout.local_expert_map(global_map, 0, experts_per_rank)
    lay = layout.expert_positions(local_map, 4, 16)
    layout.sparse_to_dense_slots(need[0], 0)
    permuted, probs = movement.permute_tokens(recv, recv_probs, lay.positions, 16)
    rows, _ = movement.unpermute_tokens(permuted, probs, lay.positions)
    out = movement.reduce_over_ranks(rows.view(world, tokens, -1), need[0])
    movement.scatter_probs_over_ranks(recv_probs.view(world, tokens, -1), need[0])
    rank_of_row = torch.arange(world, device=device).repeat_interleave(tokens)
    token_of_row = torch.where(
        need[0].t().reshape(-1), torch.arange(tokens, device=device).repeat(world), -1
    )
    movement.combine_rows(rows, recv_probs, rank_of_row, token_of_row, world, tokens)
    return out
