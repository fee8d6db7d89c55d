"""The reference backend: HybridEP semantics over any `torch.distributed` group.

Why: it runs wherever `torch.distributed` does (gloo on CPU in CI, NCCL on GPU) and it is the
specification the CUDA backend is checked against bit for bit. Rows travel as `uint8` bytes
(token bytes, then the fp32 prob slice) in one `all_to_all_single` per step, because gloo's
support of bf16 and bool varies.

Two transfer layouts (recorded in the handle):
- blocking: compact receive rows, variable splits; the split sizes are read on the host.
- static budget: every rank sends one (possibly zeroed) row per own token to every rank
  with equal splits (each block padded to `max_num_of_tokens_per_rank` rows), so nothing is
  read back to the host; the receive buffer has W*T rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from hybridep import layout, movement
from hybridep.backends import BufferSpec
from hybridep.handle import DispatchHandle


def _to_bytes(hidden: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
    parts = [hidden.contiguous().view(torch.uint8)]
    if probs is not None:
        parts.append(probs.contiguous().view(torch.uint8))
    return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]


def _from_bytes(
    payload: torch.Tensor, dtype: torch.dtype, hidden_dim: int, with_probs: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    token_bytes = hidden_dim * torch.empty((), dtype=dtype).element_size()
    hidden = payload[..., :token_bytes].contiguous().view(dtype)
    if not with_probs:
        return hidden, None
    return hidden, payload[..., token_bytes:].contiguous().view(torch.float32)


class TorchBackend:
    """Reference HybridEP backend over `all_gather_into_tensor` / `all_to_all_single`."""

    name = "torch"

    @classmethod
    def unavailable_reason(cls, group: Any) -> str | None:
        return None

    def __init__(self, group: Any, spec: BufferSpec) -> None:
        self.group = group
        self.spec = spec
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def grow(self, max_num_of_tokens_per_rank: int) -> None:
        """Collective in effect (every rank calls it at the same dispatch): the fixed-size
        messages of preprocessing and of the static layout are sized from this maximum."""
        self.spec = dataclasses.replace(
            self.spec, max_num_of_tokens_per_rank=max_num_of_tokens_per_rank
        )

    # -- preprocessing -------------------------------------------------------------------
    def _all_gather_map(self, routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """All-gather `[W, T, E]` routing maps plus every rank's token count.

        The message has a fixed size (a header holding T as int64 bytes, then
        `max_num_of_tokens_per_rank` map rows) so ranks that pass different T (a caller bug)
        still meet in the collective instead of crashing or hanging inside gloo/NCCL; the
        counts then name the mismatch.
        """
        tokens, experts = routing_map.shape
        header = -(-8 // experts)
        rows = header + self.spec.max_num_of_tokens_per_rank
        local = torch.zeros((rows, experts), dtype=torch.uint8, device=routing_map.device)
        count = torch.tensor([tokens], dtype=torch.int64).view(torch.uint8)
        local.view(-1)[:8] = count.to(routing_map.device)
        local[header : header + tokens] = routing_map.view(torch.uint8)
        gathered = local.new_empty((self.world_size * rows, experts))
        dist.all_gather_into_tensor(gathered, local, group=self.group)
        gathered = gathered.view(self.world_size, rows, experts)
        counts = gathered[:, :header].reshape(self.world_size, -1)[:, :8].contiguous()
        global_map = gathered[:, header : header + tokens].view(torch.bool)
        return global_map, counts.view(torch.int64).view(self.world_size)

    def preprocess(
        self,
        routing_map: torch.Tensor,
        *,
        pad_multiple: int,
        num_permuted_tokens: int | None,
        token_counts_checked: bool = False,
    ) -> DispatchHandle:
        num_local = self.spec.num_local_experts
        global_map, token_counts = self._all_gather_map(routing_map)
        uneven = (token_counts != routing_map.shape[0]).any()
        need = layout.rank_need(global_map, num_local)  # [W(src), T, W(dst)]
        slots_map = layout.local_expert_map(global_map, self.rank, num_local)
        static = num_permuted_tokens is not None
        if static:
            positions = layout.expert_positions(slots_map, pad_multiple, num_permuted_tokens)
            dense_map = positions.positions
            sparse = layout.sparse_to_dense_slots(need[self.rank], self.rank)
            send_counts = recv_counts = None
            num_rows = global_map.shape[0] * global_map.shape[1]
            budget = num_permuted_tokens
        else:
            # every rank sees the same counts, so every rank raises (unless the caller
            # compared them on the host already: not read a second time)
            if not token_counts_checked and bool(uneven):
                raise ValueError(
                    f"hybridep: ranks passed different token counts {token_counts.tolist()}; "
                    "every rank must dispatch the same number of tokens (pad them, e.g. "
                    "Megatron's moe_hybridep_pad_uneven_dispatch_inputs)"
                )
            positions = layout.expert_positions(slots_map, pad_multiple, None)
            to_me = need[:, :, self.rank].reshape(-1)
            dense_map = positions.positions[to_me]  # host-synchronizing, allowed here
            sparse = layout.sparse_to_dense_compact(need, self.rank)
            send_counts = tuple(need[self.rank].sum(0).tolist())
            recv_counts = tuple(need[:, :, self.rank].sum(1).tolist())
            num_rows = dense_map.shape[0]
            budget = int(positions.tokens_per_expert.sum())
        tokens_per_expert = positions.tokens_per_expert
        if not static:
            tokens_per_expert = tokens_per_expert.cpu()
        return DispatchHandle(
            rank=self.rank,
            world_size=self.world_size,
            num_tokens=routing_map.shape[0],
            hidden_dim=self.spec.hidden_dim,
            num_experts_per_rank=num_local,
            pad_multiple=pad_multiple,
            static_budget=static,
            num_permuted_tokens=budget,
            num_recv_rows=num_rows,
            send_counts=send_counts,
            recv_counts=recv_counts,
            sparse_to_dense_map=sparse,
            dense_to_expert_map=dense_map.to(torch.int32),
            tokens_per_expert=tokens_per_expert,
            # In static-budget mode uneven token counts cannot be checked on the host; they
            # raise the flag instead (the layout is then meaningless).
            overflow_flag=positions.overflow_flag | uneven.to(torch.int32),
        )

    # -- communication -------------------------------------------------------------------
    def _exchange(
        self, payload: torch.Tensor, out_rows: int, out_splits=None, in_splits=None
    ) -> torch.Tensor:
        received = payload.new_empty((out_rows, payload.shape[-1]))
        dist.all_to_all_single(
            received,
            payload,
            output_split_sizes=None if out_splits is None else list(out_splits),
            input_split_sizes=None if in_splits is None else list(in_splits),
            group=self.group,
        )
        return received

    def _exchange_static(self, rows: torch.Tensor) -> torch.Tensor:
        """Equal-split exchange of `[W, T, B]` rows (block d goes to rank d).

        Each block travels padded to `max_num_of_tokens_per_rank` rows, a size every rank
        agrees on without reading anything back, so even a caller passing different T on
        different ranks meets a matching collective (the overflow flag reports that case).
        """
        world, tokens, width = rows.shape
        capacity = self.spec.max_num_of_tokens_per_rank
        if tokens < capacity:
            rows = torch.cat([rows, rows.new_zeros((world, capacity - tokens, width))], dim=1)
        received = self._exchange(rows.reshape(world * capacity, width), world * capacity)
        return received.view(world, capacity, width)[:, :tokens].reshape(world * tokens, width)

    def dispatch(
        self, hidden: torch.Tensor, probs: torch.Tensor | None, handle: DispatchHandle
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        world, tokens, num_local = handle.world_size, handle.num_tokens, handle.num_experts_per_rank
        need_own = handle.sparse_to_dense_map >= 0  # [T, W]
        probs_by_rank = None if probs is None else probs.view(tokens, world, num_local)
        if handle.static_budget:
            rows = _to_bytes(
                hidden.unsqueeze(0).expand(world, -1, -1),
                None if probs_by_rank is None else probs_by_rank.transpose(0, 1),
            )  # [W, T, B]
            rows = torch.where(need_own.t().unsqueeze(2), rows, torch.zeros_like(rows))
            received = self._exchange_static(rows)
        else:
            dest, token = need_own.t().nonzero(as_tuple=True)  # ordered by rank, then token
            send_probs = None if probs_by_rank is None else probs_by_rank[token, dest]
            payload = _to_bytes(hidden[token], send_probs)
            received = self._exchange(
                payload, handle.num_recv_rows, handle.recv_counts, handle.send_counts
            )
        return _from_bytes(received, hidden.dtype, hidden.shape[1], probs is not None)

    def combine(
        self, hidden: torch.Tensor, probs: torch.Tensor | None, handle: DispatchHandle
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        world, tokens = handle.world_size, handle.num_tokens
        need_own = handle.sparse_to_dense_map >= 0
        payload = _to_bytes(hidden, probs)
        if handle.static_budget:
            back = self._exchange_static(payload.view(world, tokens, payload.shape[-1]))
            arange = torch.arange(tokens, device=hidden.device)
            rank_of_row = torch.arange(world, device=hidden.device).repeat_interleave(tokens)
            token_of_row = torch.where(need_own.t().reshape(-1), arange.repeat(world), -1)
        else:
            back = self._exchange(
                payload, sum(handle.send_counts), handle.send_counts, handle.recv_counts
            )
            rank_of_row, token_of_row = need_own.t().nonzero(as_tuple=True)
        back_hidden, back_probs = _from_bytes(
            back, hidden.dtype, hidden.shape[1], probs is not None
        )
        return movement.combine_rows(
            back_hidden, back_probs, rank_of_row, token_of_row, world, tokens
        )

    # -- local permutation ---------------------------------------------------------------
    def permute(
        self, recv_hidden: torch.Tensor, recv_probs: torch.Tensor | None, handle: DispatchHandle
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return movement.permute_tokens(
            recv_hidden,
            recv_probs,
            handle.dense_to_expert_map.to(torch.int64),
            handle.num_permuted_tokens,
        )

    def unpermute(
        self, tokens: torch.Tensor, probs: torch.Tensor | None, handle: DispatchHandle
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return movement.unpermute_tokens(tokens, probs, handle.dense_to_expert_map.to(torch.int64))
