"""W HybridEP ranks in ONE process on one GPU, for timing the kernels alone.

Why: on one lent GPU, W rank processes time-slice the device and meet at barriers, so their
figures measure the scheduler as much as the kernels. Here every simulated rank's registered
area is a plain allocation of this process and the peer-pointer tables point at them, exactly
what CUDA IPC gives each rank on an NVLink node; the dispatch and combine kernels of the W
ranks are launched back to back on one stream, with nothing else (no barrier, no clone, no
staging copy) in the timed region. The bytes every rank moves over that time, against a
device-to-device copy, is the kernels' fraction of the copy limit.

Every timed output is compared bit for bit with the reference semantics (hybridep.layout and
hybridep.movement's order: rows in source-rank-then-token order, fp32 sums in rank order,
rounded once), computed here with torch ops.

The torch baseline is what a team without HybridEP runs on one node: gather each rank's rows
into a send buffer in destination order, an all-to-all, and for combine the all-to-all back
and an fp32 index-add reduction. In one process the all-to-all is stood in for by ONE copy of
all the bytes it moves (a lower bound of NCCL's time on one GPU), so the baseline is never
slower than the real one.

With `kernels=False` (a dry run on CPU) the reference functions stand in for the kernels, so
the harness (layouts, pointer tables, byte accounting, comparisons) runs without a GPU.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from hybridep import layout


@dataclass
class Case:
    world: int
    tokens: int
    hidden: int
    local: int
    topk: int
    dtype: torch.dtype = torch.bfloat16
    seed: int = 0

    def __str__(self) -> str:
        return f"W={self.world} T={self.tokens} H={self.hidden} L={self.local} top-{self.topk}"


class LocalWorld:
    """The inputs, layouts, registered areas and launch parameters of W simulated ranks."""

    def __init__(self, case: Case, device: str, kernels: bool) -> None:
        self.case, self.device, self.kernels = case, torch.device(device), kernels
        W, T, H, L = case.world, case.tokens, case.hidden, case.local
        E = W * L
        gen = torch.Generator(device=self.device).manual_seed(case.seed)
        scores = torch.rand(W, T, E, generator=gen, device=self.device)
        top = scores.topk(min(case.topk, E), dim=-1).indices
        self.maps = torch.zeros(W, T, E, dtype=torch.bool, device=self.device).scatter_(
            -1, top, True
        )
        # integers in [-8, 8] as bf16: exact, and sums of a few are exact too, so a wrong
        # row or order shows up; random fp values at the same bytes for timing would be the
        # same traffic
        self.hidden = torch.randint(-8, 9, (W, T, H), generator=gen, device=self.device).to(
            case.dtype
        )
        self.probs = torch.rand(W, T, E, generator=gen, device=self.device) * self.maps
        self.need = layout.rank_need(self.maps, L)  # [W(source), T, W(destination)]
        self.sparse = [layout.sparse_to_dense_compact(self.need, r) for r in range(W)]
        self.recv_rows = [int(self.need[:, :, d].sum()) for d in range(W)]
        rows_max = max(max(self.recv_rows), 1)
        self.areas = torch.zeros(W, rows_max, H, dtype=case.dtype, device=self.device)
        self.prob_areas = torch.zeros(W, rows_max, L, dtype=torch.float32, device=self.device)
        self.out = torch.zeros(W, T, H, dtype=case.dtype, device=self.device)
        self.out_probs = torch.zeros(W, T, E, dtype=torch.float32, device=self.device)
        self._params: dict[str, list] = {}
        if kernels:
            self._bind_kernels()

    # -- the kernels, W ranks back to back ---------------------------------------------
    def _bind_kernels(self) -> None:
        from hybridep import build_hybridep_abi as abi
        from hybridep.backends import cuda

        self.lib = abi.load_library()
        W, L = self.case.world, self.case.local
        # the kernels' own layout, compared with the reference's before anything is timed
        self.kernel_sparse = [
            cuda.compute_layout(self.lib, self.maps, r, L, 1, None)["sparse_to_dense"]
            for r in range(W)
        ]
        self.status = torch.zeros(abi.STATUS_WORDS, dtype=torch.int32, device=self.device)
        self.peer_tokens = torch.tensor(
            [self.areas[d].data_ptr() for d in range(W)], dtype=torch.int64, device=self.device
        )
        self.peer_probs = torch.tensor(
            [self.prob_areas[d].data_ptr() for d in range(W)], dtype=torch.int64,
            device=self.device,
        )  # fmt: skip
        stream = torch.cuda.current_stream(self.device).cuda_stream
        code = abi.DTYPE_CODES[str(self.case.dtype).removeprefix("torch.")]

        def params(rank: int, hidden: torch.Tensor, probs: torch.Tensor):
            return abi.IntraParams.make(
                device=self.device.index or 0, dtype=code, world_size=W, rank=rank,
                num_tokens=self.case.tokens, num_local_experts=L, hidden_dim=self.case.hidden,
                static_budget=0, num_sms=0, with_probs=1,
                sparse_to_dense=self.kernel_sparse[rank].data_ptr(),
                peer_tokens=self.peer_tokens.data_ptr(), peer_probs=self.peer_probs.data_ptr(),
                hidden=hidden.data_ptr(), probs=probs.data_ptr(),
                status=self.status.data_ptr(), stream=stream,
            )  # fmt: skip

        self._params["dispatch"] = [
            ctypes.byref(params(r, self.hidden[r], self.probs[r])) for r in range(W)
        ]
        self._params["combine"] = [
            ctypes.byref(params(r, self.out[r], self.out_probs[r])) for r in range(W)
        ]

    def layouts_agree(self) -> bool:
        """The kernels' sparse_to_dense equals the reference layout on every rank."""
        if not self.kernels:
            return True
        return all(torch.equal(k, r) for k, r in zip(self.kernel_sparse, self.sparse, strict=True))

    def dispatch(self) -> None:
        """Every rank's dispatch: rows (and prob slices) into every destination's area."""
        if not self.kernels:
            self._reference_dispatch_into_areas()
            return
        for p in self._params["dispatch"]:
            status = self.lib.art_hybridep_dispatch(p)
            if status:
                raise RuntimeError(f"art_hybridep_dispatch returned {status}")

    def combine(self) -> None:
        """Every rank's combine: its tokens' rows pulled from every area and summed."""
        if not self.kernels:
            out, out_probs = self.expected_combine()
            self.out.copy_(out)
            self.out_probs.copy_(out_probs)
            return
        for p in self._params["combine"]:
            status = self.lib.art_hybridep_combine(p)
            if status:
                raise RuntimeError(f"art_hybridep_combine returned {status}")

    # -- reference semantics -------------------------------------------------------------
    def expected_dispatch(self, dest: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `[N_d, H]` and prob slices `[N_d, L]` rank `dest` receives."""
        L = self.case.local
        sel = self.need[:, :, dest]  # [W, T]
        rows = self.hidden[sel]  # boolean mask in (source, token) order
        probs = self.probs[:, :, dest * L : (dest + 1) * L][sel]
        return rows, probs

    def _reference_dispatch_into_areas(self) -> None:
        for d in range(self.case.world):
            rows, probs = self.expected_dispatch(d)
            self.areas[d, : rows.shape[0]] = rows
            self.prob_areas[d, : rows.shape[0]] = probs

    def expected_combine(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`[W, T, H]` and `[W, T, E]`: each rank's tokens summed over the areas in rank
        order in fp32 from +0.0, rounded once; prob slices scattered back."""
        W, T, H, L = self.case.world, self.case.tokens, self.case.hidden, self.case.local
        out = torch.zeros(W, T, H, dtype=self.case.dtype, device=self.device)
        out_probs = torch.zeros(W, T, W * L, dtype=torch.float32, device=self.device)
        for s in range(W):
            acc = torch.zeros(T, H, dtype=torch.float32, device=self.device)
            for d in range(W):
                row = self.sparse[s][:, d].long()
                mask = row >= 0
                acc[mask] = acc[mask] + self.areas[d][row[mask]].float()
                out_probs[s, mask, d * L : (d + 1) * L] = self.prob_areas[d][row[mask]]
            out[s] = acc.to(self.case.dtype)
        return out, out_probs

    def dispatch_matches(self) -> bool:
        """Bitwise: every area's first N_d rows and prob slices are what dispatch owes it."""
        for d in range(self.case.world):
            rows, probs = self.expected_dispatch(d)
            n = rows.shape[0]
            if not (torch.equal(self.areas[d, :n].view(torch.int16), rows.view(torch.int16))
                    and torch.equal(self.prob_areas[d, :n], probs)):  # fmt: skip
                return False
        return True

    def combine_matches(self) -> bool:
        out, out_probs = self.expected_combine()
        return torch.equal(self.out.view(torch.int16), out.view(torch.int16)) and torch.equal(
            self.out_probs, out_probs
        )

    def fill_areas_for_combine(self) -> None:
        """Distinct rows to return (expert outputs stand-in), so the sums are not the
        dispatched rows over again."""
        gen = torch.Generator(device=self.device).manual_seed(self.case.seed + 1)
        self.areas.copy_(
            torch.randint(-8, 9, self.areas.shape, generator=gen, device=self.device).to(
                self.case.dtype
            )
        )

    # -- byte accounting -----------------------------------------------------------------
    def moved_bytes(self, op: str) -> int:
        """Bytes read + written by every rank's `op` (token rows only; the fp32 prob slices
        are < 1% at the sizes timed and are left out, which understates our rate)."""
        row = self.case.hidden * self.case.dtype.itemsize
        received = sum(self.recv_rows)
        if op == "dispatch":
            return 2 * received * row
        return (received + self.case.world * self.case.tokens) * row


class TorchPath:
    """The single-process stand-in of the torch all-to-all path on the same routing (see the
    module docstring): preallocated buffers, one a2a-sized copy each way."""

    def __init__(self, world: LocalWorld) -> None:
        self.w = world
        case, dev = world.case, world.device
        W = case.world
        # send order: per source rank, destination-major, token order within
        self.send_index = []
        for s in range(W):
            need = world.need[s]  # [T, W]
            idx = [torch.nonzero(need[:, d]).flatten() for d in range(W)]
            self.send_index.append(torch.cat(idx))
        total = sum(int(i.numel()) for i in self.send_index)
        self.send = torch.empty(total, case.hidden, dtype=case.dtype, device=dev)
        self.recv = torch.empty_like(self.send)
        self.out = torch.empty(W, case.tokens, case.hidden, dtype=case.dtype, device=dev)

    def dispatch(self) -> None:
        at = 0
        for s, idx in enumerate(self.send_index):
            n = idx.numel()
            torch.index_select(self.w.hidden[s], 0, idx, out=self.send[at : at + n])
            at += n
        self.recv.copy_(self.send)  # the all-to-all's bytes, once

    def combine(self) -> None:
        self.send.copy_(self.recv)  # the all-to-all back
        at = 0
        T, H = self.w.case.tokens, self.w.case.hidden
        for s, idx in enumerate(self.send_index):  # the returned rows add to these tokens
            n = idx.numel()
            acc = torch.zeros(T, H, dtype=torch.float32, device=self.w.device)
            acc.index_add_(0, idx, self.send[at : at + n].float())
            self.out[s] = acc.to(self.w.case.dtype)
            at += n
