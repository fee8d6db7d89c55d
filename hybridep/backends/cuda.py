"""CUDA backend of `hybridep.Buffer`: our kernels (csrc/hybridep), one NVLink domain.

Why this shape: every rank `cudaMalloc`s one *registered* block and shares it with the others
through CUDA IPC; dispatch then writes each token straight into the receive row it will
occupy on every destination rank, and combine pulls its tokens' rows back from every peer and
reduces them, so no staging copy or host-side all-to-all sits on the path. The reference
backend (`torch_ref`) is the specification: maps, permuted rows and reductions are equal bit
for bit (same fp32 summation order, one rounding).

Registered block of each rank (offsets 256-byte aligned):

| region  | bytes                 | use                                                    |
| ------- | --------------------- | ------------------------------------------------------ |
| header  | 64 + 8 W, rounded     | u64 epoch, i64 T of this dispatch; at 64: arrivals[W] |
| map     | T_max * E             | this rank's routing map, read by every peer            |
| tokens  | W * T_max * H * 2     | receive rows (dispatch) / rows to return (combine)     |
| probs   | W * T_max * L * 4     | fp32 prob slices of those rows                         |

Synchronization is a device-side barrier (a one-thread kernel on rank 0's arrivals array)
before and after every step that touches a peer's memory, so nothing here synchronizes the
host except the blocking layout's counts. A barrier that waits longer than
`HybridEPConfig.barrier_timeout_s` records the missing rank in the buffer's status block
(pinned host memory the device writes), later cross-rank kernels skip their work, and the next
call (or the blocking layout's own synchronization) raises `BarrierTimeout` naming that rank:
the call fails, the CUDA context survives.

Token counts: every rank publishes its T in its header with the map. Blocking mode reads them
(it synchronizes anyway) and raises on a mismatch, as the torch backend does; static-budget
mode compares them on the device and raises the overflow flag instead.

Growth (`grow`, called by `Buffer` when a dispatch has more tokens than the buffer was built
for) is collective: every rank closes its mappings, frees, reallocates and re-exchanges the
IPC handles. `close()` is collective too; a backend dropped without it is released by a
finalizer that only unmaps the peers' blocks and frees its own (no collective, no raise).

Launch tunables of `HybridEPConfig`: `num_sms_dispatch` / `num_sms_combine` are the SM
budgets of the dispatch and combine kernels (grid = that many SMs times the blocks one SM
holds; the other SMs stay free for overlapping compute), `num_blocks_permute` /
`num_blocks_unpermute` cap the local kernels' grids (0 = one block per row).

Scope: one node. A group spanning hosts is refused (inter-node RDMA is not implemented);
hidden states moved between ranks are 16-bit (bf16/fp16), which is what the buffer is sized
for (fp32 is refused before anything is copied); an sm_90 GPU and `nvcc` (first use builds the
kernels) are required.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import shutil
import weakref
from typing import Any

import torch
import torch.distributed as dist

from hybridep import build as kbuild
from hybridep import build_hybridep_abi as abi
from hybridep.backends import BackendUnavailable, BarrierTimeout, BufferSpec, PeerFailed
from hybridep.handle import DispatchHandle
from hybridep.topology import GroupTopology, cuda_topology_reason, gather_topology

_ALIGN = 256
_EPOCH_OFFSET, _TOKENS_OFFSET, _ARRIVALS_OFFSET = 0, 8, 64
_MOVED_DTYPES = (torch.bfloat16, torch.float16)


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def check_single_node(hostnames: list[str]) -> None:
    """Refuse a group whose ranks sit on more than one host (inter-node is out of scope)."""
    hosts = sorted(set(hostnames))
    if len(hosts) > 1:
        raise BackendUnavailable(
            f"hybridep backend 'cuda' handles one node (CUDA IPC over NVLink), but this group "
            f"spans {len(hosts)} hosts {hosts}; inter-node (RDMA) dispatch is not implemented. "
            "Use backend='torch' for multi-node groups."
        )


def check_moved_dtype(dtype: torch.dtype) -> None:
    """The registered token area holds 2-byte elements: refuse anything else up front."""
    if dtype not in _MOVED_DTYPES:
        raise ValueError(
            f"hybridep cuda moves 16-bit hidden states {_MOVED_DTYPES}, got {dtype}; use "
            "backend='torch' for other dtypes"
        )


def registered_layout(spec: BufferSpec, world: int) -> tuple[dict[str, int], int, int]:
    """(offset of each region, total bytes, max tokens per rank) of one registered block."""
    max_tokens = _round_up(max(spec.max_num_of_tokens_per_rank, 1), spec.config.token_chunk)
    max_rows = world * max_tokens
    sizes = {
        "header": _ARRIVALS_OFFSET + 8 * world,
        "map": max_tokens * world * spec.num_local_experts,
        "tokens": max_rows * spec.hidden_dim * 2,
        "probs": max_rows * spec.num_local_experts * 4,
    }
    offsets, total = {}, 0
    for region, size in sizes.items():
        offsets[region] = total
        total += _round_up(size, _ALIGN)
    return offsets, total, max_tokens


def release_local(lib: Any, device: int, own: int, imported: tuple[int, ...]) -> None:
    """Finalizer of a backend dropped without `close()`: unmap the peers' blocks, free our own.

    Local only (a collective from a garbage collector could deadlock) and never raising (it
    may run at interpreter exit). `cudaFree` waits for the device, so a kernel still using
    the block finishes first. Peers that still map our block must not touch it any more; a
    buffer in use is closed collectively instead.
    """
    try:
        for ptr in imported:
            lib.art_hybridep_ipc_close(device, ptr)
        lib.art_hybridep_free(device, own)
    except Exception:  # interpreter shutdown: nothing left to report to
        pass


def _status_block() -> torch.Tensor:
    """int32 status words in pinned host memory: under unified addressing the device writes
    them through the same pointer and the host reads them without a synchronization."""
    return torch.zeros(abi.STATUS_WORDS, dtype=torch.int32, pin_memory=True)


class _DeviceBytes:
    """A raw device range as `__cuda_array_interface__`, so torch can view it without a copy."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class CudaBackend:
    """HybridEP kernels over CUDA IPC within one node (see module docstring)."""

    name = "cuda"

    @classmethod
    def unavailable_reason(
        cls,
        group: Any,
        build_config: kbuild.BuildConfig | None = None,
        topology: GroupTopology | None = None,
    ) -> str | None:
        """None when the kernels can run on `group`: every rank on one host with an sm_90
        GPU (`topology`, gathered from the group when not given: collective), and nvcc or a
        valid cached library here."""
        if topology is None:
            if group is None and not torch.cuda.is_available():  # no group to ask
                return "no CUDA device is visible (torch.cuda.is_available() is False)"
            topology = gather_topology(group)
        reason = cuda_topology_reason(topology)
        if reason is not None:
            return reason
        # A valid cached library loads without nvcc (e.g. carried to a machine without it).
        cached = kbuild.find_cached(abi.library_spec(), build_config)
        if shutil.which("nvcc") is None and cached is None:
            return (
                "nvcc is not on PATH and the kernel cache holds no valid HybridEP library, so "
                "the kernels cannot be built on first use"
            )
        return None

    def __init__(
        self, group: Any, spec: BufferSpec, build_config: kbuild.BuildConfig | None = None
    ) -> None:
        reason = self.unavailable_reason(group, build_config)
        if reason is not None:
            raise BackendUnavailable(f"hybridep backend 'cuda' cannot run: {reason}")
        self.group, self.spec = group, spec
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = torch.cuda.current_device()
        self.torch_device = torch.device("cuda", self.device)
        self.lib = abi.load_library(build_config)
        self._closed = True
        self._finalizer: weakref.finalize | None = None
        self._allocate()

    # -- registered memory ---------------------------------------------------------------
    def _allocate(self) -> None:
        world = self.world_size
        self._offsets, total, self.max_tokens = registered_layout(self.spec, world)
        # device-written, host-read without a sync (pinned memory is mapped under UVA)
        self._status = _status_block()
        own = ctypes.c_void_p()
        self._check(self.lib.art_hybridep_alloc(self.device, total, ctypes.byref(own)), "alloc")
        self._own = own.value
        handle = ctypes.create_string_buffer(64)
        self._check(self.lib.art_hybridep_ipc_handle(self.device, self._own, handle), "ipc")
        handles: list[Any] = [None] * world
        dist.all_gather_object(handles, handle.raw, group=self.group)
        self._bases = []
        for peer, peer_handle in enumerate(handles):
            if peer == self.rank:  # a process cannot open its own handle
                self._bases.append(self._own)
                continue
            mapped = ctypes.c_void_p()
            self._check(
                self.lib.art_hybridep_ipc_open(self.device, peer_handle, ctypes.byref(mapped)),
                f"ipc_open(rank {peer})",
            )
            self._bases.append(mapped.value)
        self._closed = False
        imported = tuple(b for peer, b in enumerate(self._bases) if peer != self.rank)
        self._finalizer = weakref.finalize(
            self, release_local, self.lib, self.device, self._own, imported
        )
        dev = self.torch_device
        self._peer_tokens = torch.tensor(
            [b + self._offsets["tokens"] for b in self._bases], dtype=torch.int64, device=dev
        )
        self._peer_probs = torch.tensor(
            [b + self._offsets["probs"] for b in self._bases], dtype=torch.int64, device=dev
        )

    def close(self) -> None:
        """Collective: unmap peers' blocks, then free our own (importers close first)."""
        if self._closed:
            return
        if self._finalizer is not None:
            self._finalizer.detach()  # released here, collectively, not by the finalizer
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        for peer, base in enumerate(self._bases):
            if peer != self.rank:
                self._check(self.lib.art_hybridep_ipc_close(self.device, base), "ipc_close")
        dist.barrier(group=self.group)
        self._check(self.lib.art_hybridep_free(self.device, self._own), "free")
        self._closed = True

    def grow(self, max_num_of_tokens_per_rank: int) -> None:
        """Collective: reallocate the registered blocks for a larger T and re-exchange them."""
        self.close()
        self.spec = dataclasses.replace(
            self.spec, max_num_of_tokens_per_rank=max_num_of_tokens_per_rank
        )
        self._allocate()

    def _view(self, region: str, nbytes: int) -> torch.Tensor:
        """uint8 view of `nbytes` of this rank's own `region` (its own allocation, so torch
        sees a pointer of this device). Peers' regions are never wrapped as tensors: torch
        would ask the driver which device owns the pointer and open a context on every peer
        GPU; they are read with `_peer_bytes` instead."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8, device=self.torch_device)
        ptr = self._own + self._offsets[region]
        return torch.as_tensor(_DeviceBytes(ptr, nbytes), device=self.torch_device)

    def _peer_bytes(self, rank: int, region: str, nbytes: int, offset: int = 0) -> torch.Tensor:
        """A copy (on this device, stream-ordered, no host sync) of `nbytes` of `rank`'s
        `region` from `offset`, through `art_hybridep_memcpy_d2d` on the mapped pointer."""
        out = torch.empty(nbytes, dtype=torch.uint8, device=self.torch_device)
        if nbytes:
            src = self._bases[rank] + self._offsets[region] + offset
            status = self.lib.art_hybridep_memcpy_d2d(
                self.device, out.data_ptr(), src, nbytes, self._stream()
            )
            self._check(status, f"memcpy from rank {rank}'s {region}")
        return out

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(
                f"hybridep CUDA {what} failed with status {status} on rank {self.rank}"
            )

    def check_status(self) -> None:
        """Raise `BarrierTimeout` or `PeerFailed` if a barrier of this buffer recorded a
        failure (no synchronization: the device writes the status block in pinned host
        memory)."""
        if self._closed:
            raise RuntimeError("hybridep cuda: the buffer is closed; build a new one")
        status = self._status.tolist()
        if status[0] == abi.STATUS_BARRIER_TIMEOUT:
            raise BarrierTimeout(
                f"hybridep cuda: a cross-rank barrier on rank {self.rank} timed out after "
                f"{self.spec.config.barrier_timeout_s} s waiting for rank {status[1]} (barrier "
                f"epoch {status[2]}); the kernels after it were skipped. This buffer is "
                "unusable: close() it on every rank and build a new one (raise "
                "HybridEPConfig.barrier_timeout_s if ranks are legitimately that far apart)"
            )
        if status[0] == abi.STATUS_PEER_FAILED:
            raise PeerFailed(
                f"hybridep cuda: rank {status[1]}'s call failed (it raised; see its log) at "
                f"barrier epoch {status[2]}, so the rows of that call are not trustworthy on "
                f"rank {self.rank}. This buffer is unusable: close() it on every rank and "
                "build a new one"
            )
        if status[0] != 0:
            raise RuntimeError(f"hybridep cuda: unknown status {status} on rank {self.rank}")

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def _barrier(self, abort: bool = False) -> None:
        params = abi.BarrierParams.make(
            device=self.device,
            world_size=self.world_size,
            rank=self.rank,
            abort_flag=int(abort),
            arrivals=self._bases[0] + self._offsets["header"] + _ARRIVALS_OFFSET,
            epoch=self._own + self._offsets["header"] + _EPOCH_OFFSET,
            timeout_ns=int(self.spec.config.barrier_timeout_s * 1e9),
            status=self._status.data_ptr(),
            stream=self._stream(),
        )
        self._check(self.lib.art_hybridep_barrier(ctypes.byref(params)), "barrier")

    @contextlib.contextmanager
    def _fenced(self, barriers: int):
        """The work of one collective call that passes `barriers` cross-rank barriers
        (yielded as a function to call at each). If the work raises anywhere, even before
        its first barrier, this rank still passes every barrier it has not reached, flagged
        as aborting: peers never wait for a timeout, and every rank records `PeerFailed` so
        their next call raises instead of using rows this rank never wrote. The original
        exception propagates.

        Argument checks run before it: a refused input touches nothing and costs no barrier,
        so the buffer stays usable (a program refused on one rank only leaves its peers at
        their first barrier until `barrier_timeout_s`, naming this rank)."""
        passed = 0

        def barrier() -> None:
            nonlocal passed
            passed += 1  # counted first: a barrier that failed to launch is not retried
            self._barrier()

        try:
            yield barrier
        except BaseException:
            for _ in range(barriers - passed):
                with contextlib.suppress(Exception):  # the original error is the one to see
                    self._barrier(abort=True)
            raise
        if passed != barriers:
            raise AssertionError(f"hybridep cuda: a call passed {passed} of {barriers} barriers")

    # -- preprocessing -------------------------------------------------------------------
    def preprocess(
        self,
        routing_map: torch.Tensor,
        *,
        pad_multiple: int,
        num_permuted_tokens: int | None,
        token_counts_checked: bool = False,
    ) -> DispatchHandle:
        self.check_status()
        world, rank, num_local = self.world_size, self.rank, self.spec.num_local_experts
        tokens, experts = routing_map.shape
        if experts != world * num_local:
            raise ValueError(
                f"hybridep cuda: routing_map has {experts} experts, expected W*L = "
                f"{world}*{num_local}"
            )
        if tokens > self.max_tokens:
            raise ValueError(
                f"hybridep cuda: {tokens} tokens exceed the buffer's {self.max_tokens} per rank"
            )
        with self._fenced(2) as barrier:
            dev = self.torch_device
            map_bytes = routing_map.to(dev).contiguous().view(torch.uint8).reshape(-1)
            header = self._view("header", _TOKENS_OFFSET + 8)
            header[_TOKENS_OFFSET:].view(torch.int64).fill_(tokens)  # a device fill
            self._view("map", map_bytes.numel()).copy_(map_bytes)
            barrier()  # every rank's map and count are in place
            static = num_permuted_tokens is not None
            counts = None
            if static or not token_counts_checked:  # else the caller compared them already
                counts = torch.cat([
                    self._peer_bytes(r, "header", 8, offset=_TOKENS_OFFSET).view(torch.int64)
                    for r in range(world)
                ])  # fmt: skip
            global_map = torch.cat(
                [self._peer_bytes(r, "map", map_bytes.numel()) for r in range(world)]
            )
            barrier()  # every rank has read every map before any is overwritten
        if counts is not None and not static:  # blocking: counts read on the host, once
            host_counts = counts.tolist()
            self.check_status()
            if any(c != tokens for c in host_counts):
                raise ValueError(
                    f"hybridep: ranks passed different token counts {host_counts}; every rank "
                    "must dispatch the same number of tokens (pad them, e.g. Megatron's "
                    "moe_hybridep_pad_uneven_dispatch_inputs)"
                )
        layout = compute_layout(
            self.lib, global_map.view(world, tokens, experts), rank, num_local, pad_multiple,
            int(num_permuted_tokens) if static else None,
            num_sms=self.spec.config.num_sms_preprocessing,
        )  # fmt: skip
        need, sparse, positions = layout["need"], layout["sparse_to_dense"], layout["positions"]
        tokens_per_expert, overflow = layout["tokens_per_expert"], layout["overflow_flag"]
        slots = world * tokens
        if static:
            dense_map, num_rows, budget = positions, slots, int(num_permuted_tokens)
            send_counts = recv_counts = None
            # uneven T cannot be read on the host here: it raises the flag (on the device)
            overflow = overflow | (counts != tokens).any().to(torch.int32)
        else:  # blocking: exact sizes on the host (this is where it synchronizes)
            need3 = need.view(world, tokens, world).bool()
            dense_map = positions[need3[:, :, rank].reshape(-1)]
            send_counts = tuple(need3[rank].sum(0).tolist())
            recv_counts = tuple(need3[:, :, rank].sum(1).tolist())
            self.check_status()  # synchronized: a barrier that timed out is seen here
            num_rows = dense_map.shape[0]
            tokens_per_expert = tokens_per_expert.cpu()
            budget = int(tokens_per_expert.sum())
        return DispatchHandle(
            rank=rank, world_size=world, num_tokens=tokens, hidden_dim=self.spec.hidden_dim,
            num_experts_per_rank=num_local, pad_multiple=pad_multiple, static_budget=static,
            num_permuted_tokens=budget, num_recv_rows=num_rows, send_counts=send_counts,
            recv_counts=recv_counts, sparse_to_dense_map=sparse,
            dense_to_expert_map=dense_map.contiguous(), tokens_per_expert=tokens_per_expert,
            overflow_flag=overflow,
        )  # fmt: skip

    # -- communication -------------------------------------------------------------------
    def _intra(self, handle: DispatchHandle, hidden, probs, dtype, sms: int) -> abi.IntraParams:
        return abi.IntraParams.make(
            device=self.device, dtype=abi.DTYPE_CODES[str(dtype).removeprefix("torch.")],
            world_size=self.world_size, rank=self.rank, num_tokens=handle.num_tokens,
            num_local_experts=handle.num_experts_per_rank, hidden_dim=handle.hidden_dim,
            static_budget=int(handle.static_budget), num_sms=sms,
            with_probs=int(probs is not None),
            sparse_to_dense=_ptr(handle.sparse_to_dense_map.contiguous()),
            peer_tokens=_ptr(self._peer_tokens), peer_probs=_ptr(self._peer_probs),
            hidden=_ptr(hidden), probs=_ptr(probs), status=self._status.data_ptr(),
            stream=self._stream(),
        )  # fmt: skip

    def _received(self, handle: DispatchHandle, dtype: torch.dtype, with_probs: bool):
        """This rank's receive rows `[N, H]` (+ `[N, L]` fp32) as views of its registered
        area: valid until the next collective call of this buffer."""
        rows, width, num_local = (
            handle.num_recv_rows,
            handle.hidden_dim,
            handle.num_experts_per_rank,
        )
        recv = self._view("tokens", rows * width * 2).view(dtype).view(rows, width)
        if not with_probs:
            return recv, None
        return recv, self._view("probs", rows * num_local * 4).view(torch.float32).view(
            rows, num_local
        )

    def _push(self, hidden, probs, handle: DispatchHandle) -> tuple:
        """The dispatch collective: every rank's rows land in the receive areas. Returns
        the contiguous inputs (kept alive by the caller until the kernel ran)."""
        self.check_status()
        check_moved_dtype(hidden.dtype)
        with self._fenced(2) as barrier:
            hidden = hidden.contiguous()
            probs = None if probs is None else probs.float().contiguous()
            sms = self.spec.config.num_sms_dispatch
            params = self._intra(handle, hidden, probs, hidden.dtype, sms)
            barrier()  # peers are done with their receive rows' previous contents
            self._check(self.lib.art_hybridep_dispatch(ctypes.byref(params)), "dispatch")
            barrier()  # every row has landed
        return hidden, probs

    def dispatch(
        self, hidden: torch.Tensor, probs: torch.Tensor | None, handle: DispatchHandle
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden, probs = self._push(hidden, probs, handle)
        recv, recv_probs = self._received(handle, hidden.dtype, probs is not None)
        # copies: the caller keeps these past the next call, which reuses the area
        return recv.clone(), None if recv_probs is None else recv_probs.clone()

    def dispatch_permute(
        self, hidden: torch.Tensor, probs: torch.Tensor | None, handle: DispatchHandle
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """dispatch then permute, the permute reading the receive rows straight from the
        registered area (no copy of them): stream order finishes it before this rank's next
        barrier, so no peer overwrites the rows while they are read."""
        hidden, probs = self._push(hidden, probs, handle)
        return self.permute(*self._received(handle, hidden.dtype, probs is not None), handle)

    def _combine_outputs(self, out_dtype: torch.dtype, width: int, with_probs: bool, handle):
        """Fresh `[T, H]` (+ `[T, E]` fp32) tensors combine writes into."""
        dev = self.torch_device
        out = torch.empty(handle.num_tokens, width, dtype=out_dtype, device=dev)
        out_probs = None
        if with_probs:
            out_probs = torch.empty(
                handle.num_tokens, handle.num_experts, dtype=torch.float32, device=dev
            )
        return out, out_probs

    def combine(
        self, hidden: torch.Tensor, probs: torch.Tensor | None, handle: DispatchHandle
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        def stage():
            staged = hidden.contiguous().view(torch.uint8).reshape(-1)
            self._view("tokens", staged.numel()).copy_(staged)
            if probs is not None:
                flat = probs.float().contiguous().view(torch.uint8).reshape(-1)
                self._view("probs", flat.numel()).copy_(flat)

        return self._combine(stage, hidden.dtype, hidden.shape[1], probs is not None, handle)

    def unpermute_combine(
        self, tokens: torch.Tensor, probs: torch.Tensor | None, handle: DispatchHandle
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """unpermute straight into the registered area (its rows to return), then combine:
        no staging copy."""

        def stage():
            recv, recv_probs = self._received(handle, tokens.dtype, probs is not None)
            unpermute_rows(
                self.lib, tokens, probs, handle.dense_to_expert_map,
                max_blocks=self.spec.config.num_blocks_unpermute, out=(recv, recv_probs),
            )  # fmt: skip

        return self._combine(stage, tokens.dtype, tokens.shape[1], probs is not None, handle)

    def _combine(self, stage, dtype, width: int, with_probs: bool, handle: DispatchHandle):
        """`stage()` writes this rank's rows to return into its registered area (after the
        previous call's last barrier, no peer reads or writes it), then every rank pulls."""
        self.check_status()
        # the dtype decides the bytes written into the registered area: refused before it
        check_moved_dtype(dtype)
        with self._fenced(2) as barrier:
            stage()
            out, out_probs = self._combine_outputs(dtype, width, with_probs, handle)
            sms = self.spec.config.num_sms_combine
            params = self._intra(handle, out, out_probs, dtype, sms)
            barrier()  # every rank's rows to return are staged
            self._check(self.lib.art_hybridep_combine(ctypes.byref(params)), "combine")
            barrier()  # every rank has pulled before any area is reused
        return out, out_probs

    # -- local permutation ---------------------------------------------------------------
    def permute(
        self, recv_hidden: torch.Tensor, recv_probs: torch.Tensor | None, handle: DispatchHandle
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return permute_rows(
            self.lib, recv_hidden, recv_probs, handle.dense_to_expert_map,
            handle.num_permuted_tokens, max_blocks=self.spec.config.num_blocks_permute,
        )  # fmt: skip

    def unpermute(
        self, tokens: torch.Tensor, probs: torch.Tensor | None, handle: DispatchHandle
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return unpermute_rows(
            self.lib, tokens, probs, handle.dense_to_expert_map,
            max_blocks=self.spec.config.num_blocks_unpermute,
        )  # fmt: skip


# -- single-GPU kernels (also what the one-GPU tests drive directly) -----------------------
def _status(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"hybridep CUDA {what} failed with status {status}")


def _dtype_code(dtype: torch.dtype) -> int:
    name = str(dtype).removeprefix("torch.")
    if name not in abi.DTYPE_CODES:
        raise ValueError(f"hybridep cuda handles bf16/fp16/fp32 tokens, got {dtype}")
    return abi.DTYPE_CODES[name]


def _device_index(device: torch.device) -> int:
    """CUDA tensors always carry an index; 0 stands in for the CPU (binding tests only)."""
    return device.index if device.index is not None else 0


def _stream_of(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def compute_layout(
    lib, global_map: torch.Tensor, rank: int, num_local: int, pad_multiple: int,
    budget: int | None, num_sms: int = 0,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """The scan kernels on `global_map` (bool/uint8 [W, T, E] on the GPU) as rank `rank`;
    `num_sms` caps the elementwise launches' SMs (0: all; `num_sms_preprocessing`).

    Returns need [W*T, W] uint8, sparse_to_dense [T, W] int32, positions [W*T, L] int32
    (all slots), tokens_per_expert [L] int64 and overflow_flag [1] int32, all on the GPU.
    """
    world, tokens, _ = global_map.shape
    dev = global_map.device
    slots = world * tokens
    out = {
        "need": torch.empty(slots, world, dtype=torch.uint8, device=dev),
        "sparse_to_dense": torch.empty(tokens, world, dtype=torch.int32, device=dev),
        "positions": torch.empty(slots, num_local, dtype=torch.int32, device=dev),
        "tokens_per_expert": torch.empty(num_local, dtype=torch.int64, device=dev),
        "overflow_flag": torch.empty(1, dtype=torch.int32, device=dev),
    }
    scratch = torch.empty(2 * num_local + 1, dtype=torch.int64, device=dev)
    gmap = global_map.contiguous().view(torch.uint8)
    params = abi.LayoutParams.make(
        device=_device_index(dev), world_size=world, rank=rank, num_tokens=tokens,
        num_local_experts=num_local, pad_multiple=pad_multiple, num_sms=num_sms,
        budget=-1 if budget is None else int(budget), global_map=_ptr(gmap),
        need=_ptr(out["need"]), sparse_to_dense=_ptr(out["sparse_to_dense"]),
        positions=_ptr(out["positions"]), tokens_per_expert=_ptr(out["tokens_per_expert"]),
        overflow_flag=_ptr(out["overflow_flag"]), scratch=_ptr(scratch), stream=_stream_of(dev),
    )  # fmt: skip
    _status(lib.art_hybridep_preprocess(ctypes.byref(params)), "preprocess")
    return out


def permute_rows(lib, recv_hidden, recv_probs, positions, num_permuted: int, max_blocks: int = 0):
    """Receive rows [N, H] (+ fp32 [N, L]) -> expert-major [M, H] (+ [M]); padding zero.

    `max_blocks` caps the grid (0: one block per row, up to 65535)."""
    recv_hidden = recv_hidden.contiguous()
    recv_probs = None if recv_probs is None else recv_probs.float().contiguous()
    positions = positions.contiguous()
    dev = recv_hidden.device
    tokens = torch.empty(num_permuted, recv_hidden.shape[1], dtype=recv_hidden.dtype, device=dev)
    probs = None
    if recv_probs is not None:
        probs = torch.empty(num_permuted, dtype=torch.float32, device=dev)
    source = torch.empty(num_permuted, dtype=torch.int32, device=dev)
    params = abi.PermuteParams.make(
        device=_device_index(dev), dtype=_dtype_code(recv_hidden.dtype),
        num_recv_rows=positions.shape[0], num_permuted=num_permuted,
        hidden_dim=recv_hidden.shape[1], num_local_experts=positions.shape[1],
        positions=_ptr(positions), recv_hidden=_ptr(recv_hidden), recv_probs=_ptr(recv_probs),
        tokens=_ptr(tokens), probs=_ptr(probs), source=_ptr(source), stream=_stream_of(dev),
        max_blocks=max_blocks, with_probs=int(recv_probs is not None),
    )  # fmt: skip
    _status(lib.art_hybridep_permute(ctypes.byref(params)), "permute")
    return tokens, probs


def unpermute_rows(lib, tokens, probs, positions, max_blocks: int = 0, out=None):
    """Expert-major [M, H] (+ [M]) -> receive rows [N, H] (fp32 sum over local experts in
    index order, rounded once) (+ [N, L]).

    `out` = (rows [N, H], probs [N, L] or None): contiguous tensors to write into instead of
    fresh ones (the CUDA backend passes views of its registered area)."""
    tokens = tokens.contiguous()
    probs = None if probs is None else probs.float().contiguous()
    positions = positions.contiguous()
    rows, num_local = positions.shape
    dev = tokens.device
    if out is None:
        recv = torch.empty(rows, tokens.shape[1], dtype=tokens.dtype, device=dev)
        recv_probs = None
        if probs is not None:
            recv_probs = torch.empty(rows, num_local, dtype=torch.float32, device=dev)
    else:
        recv, recv_probs = out
        want = (rows, tokens.shape[1])
        if tuple(recv.shape) != want or recv.dtype != tokens.dtype or not recv.is_contiguous():
            raise ValueError(f"unpermute_rows: out rows must be contiguous {want} {tokens.dtype}")
        if (probs is None) != (recv_probs is None):
            raise ValueError("unpermute_rows: out probs must be given exactly when probs are")
    params = abi.PermuteParams.make(
        device=_device_index(dev), dtype=_dtype_code(tokens.dtype), num_recv_rows=rows,
        num_permuted=tokens.shape[0], hidden_dim=tokens.shape[1], num_local_experts=num_local,
        positions=_ptr(positions), recv_hidden=_ptr(recv), recv_probs=_ptr(recv_probs),
        tokens=_ptr(tokens), probs=_ptr(probs), source=None, stream=_stream_of(dev),
        max_blocks=max_blocks, with_probs=int(probs is not None),
    )  # fmt: skip
    _status(lib.art_hybridep_unpermute(ctypes.byref(params)), "unpermute")
    return recv, recv_probs
