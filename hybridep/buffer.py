"""`hybridep.Buffer`: dispatch / combine (optionally fused with permute / unpermute).

Why a facade: Megatron-core 0.19's `fused_a2a.py` calls a `HybridEPBuffer` with a fixed set
of keyword arguments and return tuples; this class accepts exactly those, validates every
input once with an error naming the bad argument, and composes the backend's steps
(preprocess, dispatch, permute / unpermute, combine). Backends (`hybridep.backends`) only
move data. See docs/hybridep.md for the semantics and the handle's fields.

Growth: Megatron sizes the buffer from the first batch it sees and expects a later, larger
dispatch to reallocate it (as DeepEP's buffer does). A dispatch with more tokens than
`max_num_of_tokens_per_rank` grows the buffer on every rank at that call (`backend.grow`,
collective) and logs it once. In blocking mode the ranks first exchange their token counts
(one tiny all-gather; the mode synchronizes anyway), so they agree: uneven counts raise on
every rank before anything is reallocated, even counts grow every rank to the same size. In
static-budget mode nothing may be read on the host, so the decision follows the local count,
which the contract requires to be equal on every rank.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from hybridep.backends import BufferSpec, select_backend
from hybridep.config import HybridEPConfig
from hybridep.handle import DispatchHandle

logger = logging.getLogger(__name__)


def _as_int(value: Any, name: str) -> int:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        value = int(value.item())
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


class Buffer:
    """Expert-parallel dispatch/combine over `group` (Megatron's `HybridEPBuffer` contract).

    Args:
        group: the `torch.distributed` process group (Megatron passes its TPxEP group).
        hidden_dim: H, the token width every call must have.
        max_num_of_tokens_per_rank: the most tokens (T) one rank expects to pass per call; a
            larger dispatch grows the buffer collectively (logged) instead of failing.
        num_local_experts: L, experts owned by each rank.
        use_fp8: FP8 dispatch; not supported (Megatron 0.19 asserts it off too).
        backend: "auto" (CUDA kernels where they can run, else torch), "torch", or "cuda"
            (raises `BackendUnavailable` where it cannot run; never falls back).
        config: launch tunables; the Megatron keyword names below overlay it.
        num_sms_dispatch_api, num_sms_combine_api, num_sms_preprocessing_api,
        num_blocks_permute, num_blocks_unpermute: Megatron's names for `HybridEPConfig`
            fields.
    """

    def __init__(
        self,
        group: Any,
        hidden_dim: int,
        max_num_of_tokens_per_rank: int,
        num_local_experts: int,
        use_fp8: bool = False,
        backend: str = "auto",
        config: HybridEPConfig | None = None,
        *,
        num_sms_dispatch_api: int | None = None,
        num_sms_combine_api: int | None = None,
        num_sms_preprocessing_api: int | None = None,
        num_blocks_permute: int | None = None,
        num_blocks_unpermute: int | None = None,
    ) -> None:
        if use_fp8:
            raise NotImplementedError(
                "hybridep.Buffer: use_fp8=True is not supported; dispatch bf16/fp32 tokens"
            )
        for name, value in (
            ("hidden_dim", hidden_dim),
            ("max_num_of_tokens_per_rank", max_num_of_tokens_per_rank),
            ("num_local_experts", num_local_experts),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"hybridep.Buffer: {name} must be an int >= 1, got {value!r}")
        self.config = HybridEPConfig.from_megatron_kwargs(
            num_sms_dispatch_api=num_sms_dispatch_api,
            num_sms_combine_api=num_sms_combine_api,
            num_sms_preprocessing_api=num_sms_preprocessing_api,
            num_blocks_permute=num_blocks_permute,
            num_blocks_unpermute=num_blocks_unpermute,
            base=config,
        )
        self.group = group
        self.hidden_dim = hidden_dim
        self.max_num_of_tokens_per_rank = max_num_of_tokens_per_rank
        self.num_local_experts = num_local_experts
        spec = BufferSpec(hidden_dim, max_num_of_tokens_per_rank, num_local_experts, self.config)
        self.backend = select_backend(backend, group)(group, spec)
        self.world_size = self.backend.world_size
        self._closed = False

    @property
    def num_experts(self) -> int:
        """E = W * L, the width of the routing map."""
        return self.world_size * self.num_local_experts

    def close(self) -> None:
        """Collective: release the backend's registered memory, if it holds any. Idempotent;
        the buffer refuses calls afterwards. (A CUDA backend dropped without it is released
        locally by a finalizer.)"""
        if self._closed:
            return
        self._closed = True
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("hybridep.Buffer: the buffer was closed; build a new one")

    # -- capacity ---------------------------------------------------------------------------
    def _token_counts(self, tokens: int) -> list[int]:
        """Every rank's token count (collective; reads the result on the host)."""
        on_gpu = dist.get_backend(self.group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else "cpu"
        mine = torch.tensor([tokens], dtype=torch.int64, device=device)
        every = mine.new_empty(self.world_size)
        dist.all_gather_into_tensor(every, mine, group=self.group)
        return every.tolist()

    def _make_room(self, tokens: int, static: bool) -> None:
        """Grow collectively when this dispatch brings more tokens than the buffer holds.

        Blocking: the counts are exchanged first; uneven counts raise on every rank (nothing
        reallocated), even ones grow every rank alike. Static budget: no host read is
        allowed, so the local count decides (equal on every rank by contract; uneven counts
        then set the overflow flag in preprocessing).
        """
        needed = tokens
        if not static:
            counts = self._token_counts(tokens)
            needed = max(counts)
            if any(c != tokens for c in counts):
                raise ValueError(
                    f"hybridep: ranks passed different token counts {counts}; every rank "
                    "must dispatch the same number of tokens (pad them, e.g. Megatron's "
                    "moe_hybridep_pad_uneven_dispatch_inputs)"
                )
        if needed <= self.max_num_of_tokens_per_rank:
            return
        chunk = self.config.token_chunk
        grown = (needed + chunk - 1) // chunk * chunk
        logger.warning(
            "hybridep.Buffer: a dispatch of %d tokens per rank exceeds "
            "max_num_of_tokens_per_rank=%d; growing the buffer to %d on every rank (a "
            "collective reallocation; build the buffer with the largest size up front to "
            "avoid it)",
            needed,
            self.max_num_of_tokens_per_rank,
            grown,
        )
        self.backend.grow(grown)
        self.max_num_of_tokens_per_rank = grown

    # -- validation ------------------------------------------------------------------------
    def _check_hidden(self, hidden: torch.Tensor, rows: int | None, what: str) -> None:
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
            shape = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden)
            raise ValueError(
                f"hybridep.Buffer: hidden must be a 2-D [{what}, H] tensor, got {shape}"
            )
        if hidden.shape[1] != self.hidden_dim:
            raise ValueError(
                f"hybridep.Buffer: hidden size mismatch: hidden has {hidden.shape[1]} columns, "
                f"the buffer was built for hidden_dim={self.hidden_dim}"
            )
        if rows is not None and hidden.shape[0] != rows:
            raise ValueError(
                f"hybridep.Buffer: hidden has {hidden.shape[0]} rows, the handle expects "
                f"{rows} ({what})"
            )

    def _check_tokens(self, hidden: torch.Tensor) -> None:
        self._check_open()
        self._check_hidden(hidden, None, "tokens")

    def _check_routing(self, hidden: torch.Tensor, routing_map: Any, probs: Any) -> None:
        tokens, experts = hidden.shape[0], self.num_experts
        if not isinstance(routing_map, torch.Tensor) or routing_map.dtype != torch.bool:
            got = routing_map.dtype if isinstance(routing_map, torch.Tensor) else type(routing_map)
            raise TypeError(f"hybridep.Buffer: routing_map must be a bool tensor, got {got}")
        if tuple(routing_map.shape) != (tokens, experts):
            raise ValueError(
                f"hybridep.Buffer: routing_map shape {tuple(routing_map.shape)} does not match "
                f"[tokens={tokens}, experts={experts}] (world size {self.world_size} x "
                f"{self.num_local_experts} local experts)"
            )
        if probs is None:
            return
        if not isinstance(probs, torch.Tensor) or probs.dtype != torch.float32:
            got = probs.dtype if isinstance(probs, torch.Tensor) else type(probs)
            raise TypeError(
                f"hybridep.Buffer: probs must be float32 (HybridEP carries fp32 probs; set "
                f"moe_router_dtype='fp32'), got {got}"
            )
        if tuple(probs.shape) != (tokens, experts):
            raise ValueError(
                f"hybridep.Buffer: probs shape {tuple(probs.shape)} does not match routing_map "
                f"{(tokens, experts)}"
            )

    def _check_handle(self, handle: Any) -> DispatchHandle:
        if not isinstance(handle, DispatchHandle):
            raise TypeError(
                f"hybridep.Buffer: handle must be the DispatchHandle a dispatch returned, got "
                f"{type(handle).__name__}"
            )
        return handle

    def _preprocess(
        self,
        hidden: torch.Tensor,
        routing_map: Any,
        probs: Any,
        num_of_experts_per_rank: int | None,
        pad_multiple: int,
        budget: int | None,
    ) -> DispatchHandle:
        if routing_map is None:
            raise ValueError("hybridep.Buffer: dispatch needs routing_map when no handle is given")
        per_rank = num_of_experts_per_rank
        if per_rank is not None and per_rank != self.num_local_experts:
            raise ValueError(
                f"hybridep.Buffer: num_of_experts_per_rank={num_of_experts_per_rank} differs "
                f"from the buffer's num_local_experts={self.num_local_experts}"
            )
        self._check_routing(hidden, routing_map, probs)
        self._make_room(hidden.shape[0], static=budget is not None)
        # blocking: _make_room exchanged and compared every rank's count on the host; the
        # backend does not read them again (one host read of the counts per dispatch)
        return self.backend.preprocess(
            routing_map,
            pad_multiple=pad_multiple,
            num_permuted_tokens=budget,
            token_counts_checked=budget is None,
        )

    # -- Megatron's fused API ---------------------------------------------------------------
    def dispatch_with_permute(
        self,
        hidden: torch.Tensor,
        *,
        routing_map: torch.Tensor | None = None,
        probs: torch.Tensor | None = None,
        scaling_factor: torch.Tensor | None = None,
        num_of_experts_per_rank: int | None = None,
        pad_multiple: int | None = None,
        num_permuted_tokens: int | torch.Tensor | None = None,
        non_blocking: bool = False,
        handle: DispatchHandle | None = None,
        fuse_permute_dispatch: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, None, torch.Tensor, DispatchHandle]:
        """Dispatch tokens to the ranks owning their experts, in expert-major order.

        Without `handle`: preprocesses `routing_map [T, E]` (bool) and `probs [T, E]` (fp32).
        With `num_permuted_tokens` (a multiple of `pad_multiple`) the layout has that static
        budget: no device-to-host synchronization, pairs past it are dropped and
        `handle[-1]` (overflow flag) becomes nonzero. Without it the exact size is computed
        (synchronizing). With `handle`: reuses its layout (combine's backward); the layout,
        budget and padding come from the handle.

        Returns:
            tokens `[M, H]` (expert blocks padded to `pad_multiple` with zero rows, then any
            unused budget rows zero), probs `[M]` fp32 (None without probs), None (no FP8
            scales), tokens_per_expert int64 `[L]` (padded block sizes; a CPU tensor when
            blocking), and the handle.
        """
        del fuse_permute_dispatch  # one path in every backend; accepted for Megatron
        if scaling_factor is not None:
            raise NotImplementedError("hybridep.Buffer: FP8 scaling_factor is not supported")
        self._check_tokens(hidden)
        pad = 1 if pad_multiple is None else _as_int(pad_multiple, "pad_multiple")
        if pad < 1:
            raise ValueError(f"hybridep.Buffer: pad_multiple must be >= 1, got {pad}")
        if handle is None:
            budget = None
            if num_permuted_tokens is not None:
                budget = _as_int(num_permuted_tokens, "num_permuted_tokens")
                if budget < 0 or budget % pad:
                    raise ValueError(
                        f"hybridep.Buffer: num_permuted_tokens={budget} must be a non-negative "
                        f"multiple of pad_multiple={pad}"
                    )
            elif non_blocking:
                raise ValueError(
                    "hybridep.Buffer: non_blocking=True needs num_permuted_tokens (a static "
                    "budget); without it the output size must be read on the host"
                )
            handle = self._preprocess(
                hidden, routing_map, probs, num_of_experts_per_rank, pad, budget
            )
        else:
            handle = self._check_handle(handle)
            if pad_multiple is not None and pad != handle.pad_multiple:
                raise ValueError(
                    f"hybridep.Buffer: pad_multiple={pad} differs from the handle's "
                    f"{handle.pad_multiple}"
                )
            self._check_hidden(hidden, handle.num_tokens, "tokens of the handle")
        fused = getattr(self.backend, "dispatch_permute", None)
        if fused is not None:  # e.g. CUDA: permutes straight from the registered area
            tokens, permuted_probs = fused(hidden, probs, handle)
        else:
            recv_hidden, recv_probs = self.backend.dispatch(hidden, probs, handle)
            tokens, permuted_probs = self.backend.permute(recv_hidden, recv_probs, handle)
        return tokens, permuted_probs, None, handle.tokens_per_expert, handle

    def combine_with_unpermute(
        self,
        hidden: torch.Tensor,
        *,
        handle: DispatchHandle,
        probs: torch.Tensor | None = None,
        pad_multiple: int | None = None,
        fuse_unpermute_combine: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Inverse layout of `dispatch_with_permute`: `[M, H]` -> `[T, H]`, unweighted.

        Each token's rows are summed in fp32 (local experts in index order, rounded to the
        dtype, then ranks in rank order, rounded again). `probs [M]` (dispatch's backward)
        comes back as `[T, E]` fp32, zero where not routed or dropped.
        """
        del fuse_unpermute_combine
        self._check_open()
        handle = self._check_handle(handle)
        pad = None if pad_multiple is None else _as_int(pad_multiple, "pad_multiple")
        if pad is not None and pad != handle.pad_multiple:
            raise ValueError(
                f"hybridep.Buffer: pad_multiple={pad_multiple} differs from the handle's "
                f"{handle.pad_multiple}"
            )
        self._check_hidden(hidden, handle.num_permuted_tokens, "num_permuted_tokens")
        if probs is not None and tuple(probs.shape) != (handle.num_permuted_tokens,):
            raise ValueError(
                f"hybridep.Buffer: combine probs must be [{handle.num_permuted_tokens}], got "
                f"{tuple(probs.shape)}"
            )
        if probs is not None:
            probs = probs.float()
        fused = getattr(self.backend, "unpermute_combine", None)
        if fused is not None:  # e.g. CUDA: unpermutes straight into the registered area
            return fused(hidden, probs, handle)
        recv_hidden, recv_probs = self.backend.unpermute(hidden, probs, handle)
        return self.backend.combine(recv_hidden, recv_probs, handle)

    # -- plain API (no permute) --------------------------------------------------------------
    def dispatch(
        self,
        hidden: torch.Tensor,
        *,
        routing_map: torch.Tensor | None = None,
        probs: torch.Tensor | None = None,
        scaling_factor: torch.Tensor | None = None,
        non_blocking: bool = False,
        handle: DispatchHandle | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, None, DispatchHandle]:
        """Dispatch without permute: receive rows `[N, H]` ordered by source rank then token.

        Returns rows, their fp32 prob slice for this rank's experts `[N, L]`, None (no FP8
        scales) and the handle. `non_blocking=True` uses the static layout (N = W*T rows,
        rows not routed here zero) and never synchronizes with the host.
        """
        if scaling_factor is not None:
            raise NotImplementedError("hybridep.Buffer: FP8 scaling_factor is not supported")
        self._check_tokens(hidden)
        if handle is None:
            budget = None
            if non_blocking:
                budget = self.world_size * hidden.shape[0] * self.num_local_experts
            handle = self._preprocess(hidden, routing_map, probs, None, 1, budget)
        else:
            handle = self._check_handle(handle)
            self._check_hidden(hidden, handle.num_tokens, "tokens of the handle")
        recv_hidden, recv_probs = self.backend.dispatch(hidden, probs, handle)
        return recv_hidden, recv_probs, None, handle

    def combine(
        self,
        hidden: torch.Tensor,
        *,
        handle: DispatchHandle,
        probs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Inverse of `dispatch`: receive rows `[N, H]` -> `[T, H]` (fp32 sum over ranks in
        rank order, rounded once); `probs [N, L]` -> `[T, E]`."""
        self._check_open()
        handle = self._check_handle(handle)
        self._check_hidden(hidden, handle.num_recv_rows, "receive rows of the handle")
        if probs is not None and tuple(probs.shape) != (
            handle.num_recv_rows,
            handle.num_experts_per_rank,
        ):
            raise ValueError(
                f"hybridep.Buffer: combine probs must be "
                f"[{handle.num_recv_rows}, {handle.num_experts_per_rank}], got {tuple(probs.shape)}"
            )
        return self.backend.combine(hidden, None if probs is None else probs.float(), handle)
