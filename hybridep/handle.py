"""The dispatch handle: everything combine and both backwards need to reuse one layout.

Why a handle: preprocessing (all-gather of the routing map plus a scan) is the only part of a
dispatch that depends on routing. The matching combine, dispatch's backward (a combine) and
combine's backward (a dispatch) reuse it, so they never repeat the all-gather and always see
an identical layout. Megatron-core treats the handle as opaque except `handle[-1]`, which must
be the overflow flag; a `NamedTuple` gives both named fields and that index.

Vocabulary (docs/hybridep.md has the full table): W ranks in the group, T tokens per rank,
L experts per rank, E = W*L experts, a *receive row* is one (source rank, token) pair that
this rank receives, ordered by source rank then token; M is `num_permuted_tokens`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class DispatchHandle(NamedTuple):
    """Layout of one dispatch on one rank (field order is part of the API: flag last).

    Attributes:
        rank: this rank's index in the group.
        world_size: W.
        num_tokens: T, tokens per rank (equal on every rank).
        hidden_dim: H.
        num_experts_per_rank: L.
        pad_multiple: P; every expert block of the permuted output is padded to it (1 = none).
        static_budget: True when dispatched with `num_permuted_tokens` (no host sync; the
            receive buffer then has one row per (source rank, token) slot, W*T rows).
        num_permuted_tokens: M, rows of the permuted output.
        num_recv_rows: rows of this rank's receive buffer (W*T in static-budget mode).
        send_counts: rows sent to each rank (blocking mode; None in static-budget mode).
        recv_counts: rows received from each rank (blocking mode; None otherwise).
        sparse_to_dense_map: int32 [T, W]; the row of each own token in each peer's receive
            buffer, or -1 when the token uses none of that peer's experts.
        dense_to_expert_map: int32 [num_recv_rows, L]; the permuted output row of each
            (receive row, local expert) pair, or -1 (not routed, or dropped over the budget).
        tokens_per_expert: int64 [L]; rows per local expert block including padding, clamped
            to the budget in static-budget mode (CPU tensor in blocking mode).
        overflow_flag: int32 [1]; nonzero when routed entries were dropped over the budget.
    """

    rank: int
    world_size: int
    num_tokens: int
    hidden_dim: int
    num_experts_per_rank: int
    pad_multiple: int
    static_budget: bool
    num_permuted_tokens: int
    num_recv_rows: int
    send_counts: tuple[int, ...] | None
    recv_counts: tuple[int, ...] | None
    sparse_to_dense_map: torch.Tensor
    dense_to_expert_map: torch.Tensor
    tokens_per_expert: torch.Tensor
    overflow_flag: torch.Tensor

    @property
    def num_experts(self) -> int:
        """E = W * L, the width of the routing map."""
        return self.world_size * self.num_experts_per_rank
