"""Backend interface of `hybridep.Buffer`, and selection by name.

Why an interface: the `torch` reference backend (`torch_ref.TorchBackend`) defines the
semantics; the CUDA backend (`cuda.CudaBackend`, built from `csrc/`) must reproduce them bit
for bit. The `Buffer` facade validates arguments and composes the five steps below, so a
backend only moves data. A backend may fuse steps internally (dispatch+permute) as long as
the results equal the composition.

Selection: `"torch"` always works (any `torch.distributed` group: gloo on CPU, NCCL on GPU).
`"cuda"` raises `BackendUnavailable` naming the reason when it cannot run (no GPU visible,
a rank off sm_90, the group spanning hosts, the module or its kernels missing); it never
falls back silently. `"auto"` picks `cuda` when the CUDA backend says it can run on the group
(`hybridep.topology`: the facts of every rank, so every rank picks alike), else `torch`,
logging why: a multi-node EP group or a non-sm90 GPU gets the torch backend instead of a
failure inside the CUDA backend's constructor (inside Megatron's `init_hybrid_ep_buffer`).
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from hybridep.config import HybridEPConfig
from hybridep.handle import DispatchHandle
from hybridep.topology import GroupTopology, gather_topology

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "torch", "cuda")
_BACKEND_CLASSES = {
    "torch": ("hybridep.backends.torch_ref", "TorchBackend"),
    "cuda": ("hybridep.backends.cuda", "CudaBackend"),
}


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here; the message says why."""


class BarrierTimeout(RuntimeError):
    """A cross-rank barrier gave up waiting for a peer (named in the message); the call
    failed, the process and its CUDA context did not. The buffer must be rebuilt."""


class PeerFailed(RuntimeError):
    """A rank's collective call raised (that rank is named); it still passed the call's
    barriers, flagged, so nobody hung, but the rows of that call are not trustworthy on any
    rank. Raised by the next call of every rank; the buffer must be rebuilt."""


@dataclass(frozen=True)
class BufferSpec:
    """The sizes a backend is built for (fixed for the buffer's lifetime)."""

    hidden_dim: int
    max_num_of_tokens_per_rank: int
    num_local_experts: int
    config: HybridEPConfig = field(default_factory=HybridEPConfig)


@runtime_checkable
class HybridEPBackend(Protocol):
    """What a backend implements. Shapes: W ranks, T tokens, H hidden, L local experts,
    E = W*L, N = `handle.num_recv_rows`, M = `handle.num_permuted_tokens`.

    Construction: `Backend(group, spec: BufferSpec)`; collective over `group`. A backend
    holding registered memory may also define `close()` (collective), which
    `Buffer.close()` calls. `grow(max_num_of_tokens_per_rank)` (collective) makes room for
    more tokens per rank; `Buffer` calls it when a dispatch brings more than the buffer was
    built for, on every rank at the same call.
    """

    name: str
    rank: int  # this rank's index in `group`
    world_size: int  # W

    @classmethod
    def unavailable_reason(cls, group: Any) -> str | None:
        """None when the backend can run on `group` here, else a sentence saying why not."""
        ...

    def preprocess(
        self,
        routing_map: torch.Tensor,
        *,
        pad_multiple: int,
        num_permuted_tokens: int | None,
        token_counts_checked: bool = False,
    ) -> DispatchHandle:
        """Collective: all-gather bool `routing_map [T, E]`, compute the layout.

        `num_permuted_tokens` None = blocking (exact M, host counts, may synchronize);
        an int = static budget M (no device-to-host sync; overflow flag on drop).
        `token_counts_checked`: the caller already exchanged every rank's T and found them
        equal on the host in this call (`Buffer` does, before it grows): blocking mode then
        does not read them on the host again.
        """
        ...

    def dispatch(
        self, hidden: torch.Tensor, probs: torch.Tensor | None, handle: DispatchHandle
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Collective: `hidden [T, H]`, fp32 `probs [T, E]` -> receive rows `[N, H]`,
        `[N, L]` (this rank's slice of each row's probs; rows not routed here are zero)."""
        ...

    def permute(
        self,
        recv_hidden: torch.Tensor,
        recv_probs: torch.Tensor | None,
        handle: DispatchHandle,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Local: receive rows -> expert-major `[M, H]`, `[M]` (padding rows zero)."""
        ...

    def unpermute(
        self, tokens: torch.Tensor, probs: torch.Tensor | None, handle: DispatchHandle
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Local: `[M, H]`, `[M]` -> receive rows `[N, H]` (fp32 sum over local experts in
        index order, rounded once), `[N, L]`."""
        ...

    def combine(
        self, hidden: torch.Tensor, probs: torch.Tensor | None, handle: DispatchHandle
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Collective: receive rows `[N, H]`, `[N, L]` -> `[T, H]` (fp32 sum over ranks in
        rank order, rounded once), `[T, E]` (disjoint scatter)."""
        ...

    def grow(self, max_num_of_tokens_per_rank: int) -> None:
        """Collective: hold up to `max_num_of_tokens_per_rank` tokens per rank from now on."""
        ...

    # Optional fused steps (Buffer uses them when a backend defines them; results must equal
    # the composition): `dispatch_permute(hidden, probs, handle)` = permute(dispatch(...)),
    # `unpermute_combine(tokens, probs, handle)` = combine(unpermute(...)).


def _load(name: str) -> type:
    module_name, class_name = _BACKEND_CLASSES[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailable(
            f"hybridep backend {name!r} is unavailable: importing {module_name} failed ({exc})"
        ) from exc
    cls = getattr(module, class_name, None)
    if cls is None:
        raise BackendUnavailable(
            f"hybridep backend {name!r} is unavailable: {module_name} defines no {class_name}"
        )
    return cls


def cuda_unavailable_reason(group: Any, topology: GroupTopology | None = None) -> str | None:
    """Why the CUDA backend cannot run on `group` here, or None when it can. `topology`:
    where the group's ranks run (default: gathered from the group, collective; without a
    group, this process alone)."""
    if topology is None and group is None and not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    try:
        cls = _load("cuda")
    except BackendUnavailable as exc:
        return str(exc)
    return cls.unavailable_reason(group, topology=topology or gather_topology(group))


def select_backend(name: str, group: Any, *, topology: GroupTopology | None = None) -> type:
    """The backend class for `name` ("auto", "torch" or "cuda") on `group` (`topology`: see
    `cuda_unavailable_reason`). "auto" logs why it takes the torch backend.

    Raises:
        ValueError: unknown name.
        BackendUnavailable: `"cuda"` requested where it cannot run (the reason is named).
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"hybridep backend must be one of {BACKEND_NAMES}, got {name!r}")
    if name == "torch":
        return _load("torch")
    reason = cuda_unavailable_reason(group, topology)
    if name == "cuda":
        if reason is not None:
            raise BackendUnavailable(
                f"hybridep backend 'cuda' cannot run: {reason}. Use backend='torch' (the "
                "reference over torch.distributed) or backend='auto'."
            )
        return _load("cuda")
    if reason is None:
        return _load("cuda")
    # a GPU that cannot take the CUDA kernels is worth a warning; a CPU run is not
    log = logger.warning if torch.cuda.is_available() else logger.info
    log("hybridep backend 'auto' uses the torch backend; the CUDA backend cannot run: %s", reason)
    return _load("torch")


__all__ = [
    "BACKEND_NAMES",
    "BackendUnavailable",
    "BarrierTimeout",
    "BufferSpec",
    "HybridEPBackend",
    "PeerFailed",
    "cuda_unavailable_reason",
    "select_backend",
]
