"""The Python side of the CUDA backend passes the right pointers, sizes and flags (CPU).

A stand-in for `libart_hybridep.so` receives the very params structs `compute_layout`,
`permute_rows` and `unpermute_rows` build, reads every input only through the raw pointers
and sizes in them (CPU memory), and writes its outputs the same way using the reference
functions. A wrong field name, pointer, size, dtype code or a missing output then shows up as
a wrong result here, on CPU, instead of as garbage on a GPU. (The kernels themselves are
checked against the same reference on an sm_90 GPU in test_cuda_backend.py.)
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from hybridep import layout, movement
from hybridep.backends import cuda as backend

_NP = {0: None, 1: np.float16, 2: np.float32}  # bf16 handled as raw uint16


def _array(ptr: int, count: int, ctype) -> np.ndarray:
    """The C contract: a pointer may be null exactly when its array has no element."""
    if count == 0:
        return np.ctypeslib.as_array((ctype * 1)())[:0]
    assert ptr, "null pointer passed where data was expected"
    return np.ctypeslib.as_array((ctype * count).from_address(ptr))


def _hidden(ptr: int, rows: int, hidden: int, code: int) -> torch.Tensor:
    if code == 0:
        raw = _array(ptr, rows * hidden, ctypes.c_uint16).view(np.int16)
        return torch.from_numpy(raw).view(torch.bfloat16).view(rows, hidden)
    ctype = ctypes.c_uint16 if code == 1 else ctypes.c_float
    raw = _array(ptr, rows * hidden, ctype).view(_NP[code])
    return torch.from_numpy(raw).view(rows, hidden)


class FakeHybridEPLib:
    """Implements three C entry points over raw CPU pointers with the reference maths."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def art_hybridep_preprocess(self, ref) -> int:
        p = ref._obj
        self.calls.append("preprocess")
        world, tokens, num_local = p.world_size, p.num_tokens, p.num_local_experts
        slots, experts = world * tokens, world * num_local
        gmap = torch.from_numpy(_array(p.global_map, slots * experts, ctypes.c_uint8).copy())
        gmap = gmap.bool().view(world, tokens, experts)
        budget = None if p.budget < 0 else p.budget
        need = layout.rank_need(gmap, num_local)
        ref_layout = layout.expert_positions(
            layout.local_expert_map(gmap, p.rank, num_local), p.pad_multiple, budget
        )
        sparse = (layout.sparse_to_dense_compact(need, p.rank) if budget is None
                  else layout.sparse_to_dense_slots(need[p.rank], p.rank))  # fmt: skip
        _array(p.need, slots * world, ctypes.c_uint8)[:] = need.reshape(-1).numpy()
        _array(p.sparse_to_dense, tokens * world, ctypes.c_int32)[:] = sparse.reshape(-1).numpy()
        _array(p.positions, slots * num_local, ctypes.c_int32)[:] = ref_layout.positions.reshape(
            -1
        ).numpy()
        _array(p.tokens_per_expert, num_local, ctypes.c_int64)[:] = (
            ref_layout.tokens_per_expert.numpy()
        )
        _array(p.overflow_flag, 1, ctypes.c_int32)[:] = ref_layout.overflow_flag.numpy()
        _array(p.scratch, 2 * num_local + 1, ctypes.c_int64)  # must be big enough to touch
        return 0

    def _positions(self, p) -> torch.Tensor:
        count = p.num_recv_rows * p.num_local_experts
        raw = _array(p.positions, count, ctypes.c_int32).copy()
        return torch.from_numpy(raw).view(p.num_recv_rows, p.num_local_experts).long()

    def art_hybridep_permute(self, ref) -> int:
        p = ref._obj
        self.calls.append("permute")
        recv = _hidden(p.recv_hidden, p.num_recv_rows, p.hidden_dim, p.dtype).clone()
        recv_probs = None
        if p.with_probs:
            count = p.num_recv_rows * p.num_local_experts
            recv_probs = torch.from_numpy(_array(p.recv_probs, count, ctypes.c_float).copy())
            recv_probs = recv_probs.view(p.num_recv_rows, p.num_local_experts)
        tokens, probs = movement.permute_tokens(recv, recv_probs, self._positions(p),
                                                p.num_permuted)  # fmt: skip
        _array(p.source, p.num_permuted, ctypes.c_int32)  # scratch must cover M rows
        _hidden(p.tokens, p.num_permuted, p.hidden_dim, p.dtype).copy_(tokens)
        if probs is not None:
            _array(p.probs, p.num_permuted, ctypes.c_float)[:] = probs.numpy()
        return 0

    def art_hybridep_unpermute(self, ref) -> int:
        p = ref._obj
        self.calls.append("unpermute")
        tokens = _hidden(p.tokens, p.num_permuted, p.hidden_dim, p.dtype).clone()
        probs = None
        if p.with_probs:
            probs = torch.from_numpy(_array(p.probs, p.num_permuted, ctypes.c_float).copy())
        recv, recv_probs = movement.unpermute_tokens(tokens, probs, self._positions(p))
        _hidden(p.recv_hidden, p.num_recv_rows, p.hidden_dim, p.dtype).copy_(recv)
        if recv_probs is not None:
            count = p.num_recv_rows * p.num_local_experts
            _array(p.recv_probs, count, ctypes.c_float)[:] = recv_probs.reshape(-1).numpy()
        return 0


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(backend, "_stream_of", lambda device: 0)
    return FakeHybridEPLib()


@pytest.mark.parametrize("budget", [None, 40, 10**5])
def test_compute_layout_passes_map_and_returns_every_output(fake, budget):
    world, tokens, num_local, pad, rank = 3, 17, 2, 4, 1
    gmap = torch.rand(world, tokens, world * num_local, generator=torch.Generator().manual_seed(3))
    gmap = gmap < 0.3
    got = backend.compute_layout(fake, gmap, rank, num_local, pad, budget)
    ref = layout.expert_positions(layout.local_expert_map(gmap, rank, num_local), pad, budget)
    need = layout.rank_need(gmap, num_local)
    assert torch.equal(got["need"].bool(), need.reshape(world * tokens, world))
    assert torch.equal(got["positions"], ref.positions.to(torch.int32))
    assert torch.equal(got["tokens_per_expert"], ref.tokens_per_expert)
    assert torch.equal(got["overflow_flag"], ref.overflow_flag)
    assert got["sparse_to_dense"].shape == (tokens, world)
    assert fake.calls == ["preprocess"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_probs", [True, False])
def test_permute_and_unpermute_pass_rows_probs_and_sizes(fake, dtype, with_probs):
    gen = torch.Generator().manual_seed(9)
    gmap = torch.rand(2, 11, 6, generator=gen) < 0.4
    positions = layout.expert_positions(layout.local_expert_map(gmap, 0, 3), 4, None)
    m = int(positions.tokens_per_expert.sum())
    pos32 = positions.positions.to(torch.int32)
    recv = torch.randn(22, 24, generator=gen).to(dtype)
    recv_probs = torch.rand(22, 3, generator=gen) if with_probs else None
    tokens, probs = backend.permute_rows(fake, recv, recv_probs, pos32, m)
    ref_tokens, ref_probs = movement.permute_tokens(recv, recv_probs, positions.positions, m)
    assert tokens.dtype == dtype and torch.equal(tokens, ref_tokens)
    assert (probs is None) == (not with_probs)
    if with_probs:
        assert torch.equal(probs, ref_probs)
    back, back_probs = backend.unpermute_rows(fake, tokens, probs, pos32)
    ref_back, ref_back_probs = movement.unpermute_tokens(ref_tokens, ref_probs, positions.positions)
    assert torch.equal(back, ref_back)
    if with_probs:
        assert torch.equal(back_probs, ref_back_probs)
    assert fake.calls == ["permute", "unpermute"]


def test_unknown_dtype_is_refused_before_any_call(fake):
    pos = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="int64"):
        backend.permute_rows(fake, torch.zeros(2, 8, dtype=torch.int64), None, pos, 2)
    assert fake.calls == []


# -- zero rows: what crosses the ABI when an array is empty ---------------------------------
def test_zero_tokens_layout_passes_null_maps_and_still_gets_counts_and_flag(fake):
    """T = 0 on every rank: the map, need, sparse and positions arrays are empty (null data
    pointers, as PyTorch gives 0-byte CUDA tensors), counts and the flag are still written."""
    gmap = torch.zeros(2, 0, 6, dtype=torch.bool)
    for budget in (None, 8):
        got = backend.compute_layout(fake, gmap, 1, 3, 4, budget)
        assert got["tokens_per_expert"].tolist() == [0, 0, 0]
        assert got["overflow_flag"].tolist() == [0]
        assert got["positions"].shape == (0, 3) and got["sparse_to_dense"].shape == (0, 2)


@pytest.mark.parametrize("with_probs", [True, False])
def test_permute_with_no_receive_row_fills_the_budget_with_zeros(fake, with_probs):
    """N = 0 receive rows (nothing routed here) but a static budget M = 8: the row arrays are
    null, the output is zero rows and zero probs; `with_probs` says whether probs travel."""
    recv = torch.zeros(0, 16, dtype=torch.bfloat16)
    recv_probs = torch.zeros(0, 2) if with_probs else None
    positions = torch.zeros(0, 2, dtype=torch.int32)
    tokens, probs = backend.permute_rows(fake, recv, recv_probs, positions, 8)
    assert tokens.shape == (8, 16) and not tokens.any()
    assert (probs is not None) == with_probs
    if with_probs:
        assert probs.shape == (8,) and not probs.any()


def test_unpermute_of_an_empty_budget_gives_zero_rows_and_probs(fake):
    """M = 0 permuted rows (a zero budget drops everything) but N = 4 receive rows: tokens
    and probs arrays are null, every receive row and prob comes back zero."""
    positions = torch.full((4, 2), -1, dtype=torch.int32)
    recv, recv_probs = backend.unpermute_rows(
        fake, torch.zeros(0, 16, dtype=torch.bfloat16), torch.zeros(0), positions
    )
    assert recv.shape == (4, 16) and not recv.any()
    assert recv_probs.shape == (4, 2) and not recv_probs.any()


# -- the CUDA backend's Python protocol, W ranks emulated by threads on CPU ----------------
class _Registered:
    """Each emulated rank's registered regions as CPU byte tensors (what IPC maps on a GPU)."""

    def __init__(self, world: int, spec) -> None:
        self.offsets, _, self.max_tokens = backend.registered_layout(spec, world)
        experts = world * spec.num_local_experts
        self.regions = [
            {"header": torch.zeros(64 + 8 * world, dtype=torch.uint8),
             "map": torch.zeros(self.max_tokens * experts, dtype=torch.uint8)}
            for _ in range(world)
        ]  # fmt: skip


class _EmulatedBarrier:
    """The device barrier's protocol on threads: every rank waits for all; a rank posting
    `abort` makes every rank record PEER_FAILED naming it once the barrier completes (what
    barrier_kernel does). `log` keeps (rank, abort) per call. It models the protocol, not
    the device's ordering (each host blocks at each barrier here, so no rank can post its
    next barrier before a peer has read this one): that is support/emulated_gpu.py, used by
    test_barrier_ordering.py."""

    def __init__(self, world: int, statuses: list[torch.Tensor]) -> None:
        import threading

        self.gate = threading.Barrier(world, timeout=20)
        self.statuses, self.log, self.aborted = statuses, [], []

    def __call__(self, rank: int, abort: bool = False) -> None:
        from hybridep import build_hybridep_abi as abi

        self.log.append((rank, abort))
        if abort:
            self.aborted.append(rank)
        self.gate.wait()
        if self.aborted:
            self.statuses[rank][:2] = torch.tensor([abi.STATUS_PEER_FAILED, min(self.aborted)])
        self.gate.wait()


def _emulated_backends(world: int, lib, max_tokens: int = 32):
    from hybridep.backends import BufferSpec

    spec = BufferSpec(hidden_dim=16, max_num_of_tokens_per_rank=max_tokens, num_local_experts=2)
    shared = _Registered(world, spec)
    statuses = [torch.zeros(4, dtype=torch.int32) for _ in range(world)]
    barrier = _EmulatedBarrier(world, statuses)
    ranks = []
    for rank in range(world):
        b = object.__new__(backend.CudaBackend)
        b.spec, b.rank, b.world_size, b.device = spec, rank, world, 0
        b.torch_device, b.lib, b.max_tokens = torch.device("cpu"), lib, shared.max_tokens
        b._closed, b._status = False, statuses[rank]
        b._view = lambda region, n, s=shared, r=rank: s.regions[r][region][:n]
        b._peer_bytes = lambda r, region, n, offset=0, s=shared: s.regions[r][region][
            offset : offset + n
        ].clone()
        b._barrier = lambda abort=False, r=rank: barrier(r, abort)
        b.emulated_barrier = barrier
        ranks.append(b)
    return ranks


def _run_threads(fns):
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(len(fns)) as pool:
        futures = [pool.submit(fn) for fn in fns]
        out = []
        for f in futures:
            try:
                out.append(f.result(timeout=60))
            except Exception as exc:  # each rank's outcome is its result
                out.append(exc)
        return out


def _routing(tokens: int, world: int, seed: int) -> torch.Tensor:
    return torch.rand(tokens, world * 2, generator=torch.Generator().manual_seed(seed)) < 0.4


@pytest.mark.parametrize("world", [2, 3])
def test_cuda_preprocess_equal_counts_matches_the_reference_layout(fake, world):
    ranks = _emulated_backends(world, fake)
    maps = [_routing(9, world, seed=r) for r in range(world)]
    handles = _run_threads([
        (lambda b=b, m=m: b.preprocess(m, pad_multiple=4, num_permuted_tokens=None))
        for b, m in zip(ranks, maps, strict=True)
    ])  # fmt: skip
    gmap = torch.stack(maps)
    for rank, handle in enumerate(handles):
        assert not isinstance(handle, Exception), handle
        ref = layout.expert_positions(layout.local_expert_map(gmap, rank, 2), 4, None)
        assert torch.equal(handle.tokens_per_expert, ref.tokens_per_expert)
        assert int(handle.overflow_flag) == 0


def test_cuda_preprocess_uneven_counts_raise_on_every_rank_when_blocking(fake):
    """The torch backend's contract: every rank raises, naming the counts (no hang)."""
    ranks = _emulated_backends(2, fake)
    out = _run_threads([
        (lambda b=b: b.preprocess(_routing(7 + 3 * b.rank, 2, b.rank), pad_multiple=1,
                                  num_permuted_tokens=None))
        for b in ranks
    ])  # fmt: skip
    for got in out:
        assert isinstance(got, ValueError) and "different token counts [7, 10]" in str(got), got


def test_blocking_preprocess_reads_no_count_again_when_the_caller_compared_them(fake):
    """`Buffer` compares every rank's T on the host before a blocking dispatch and says so;
    the backend then reads no peer's count (before, each blocking dispatch read them twice:
    the Buffer's exchange and the backend's header reads)."""
    ranks = _emulated_backends(2, fake)
    regions = []
    for b in ranks:
        inner = b._peer_bytes
        b._peer_bytes = lambda r, region, *a, inner=inner, **k: (
            regions.append(region) or inner(r, region, *a, **k)
        )
    out = _run_threads([
        (lambda b=b: b.preprocess(_routing(6, 2, b.rank), pad_multiple=1,
                                  num_permuted_tokens=None, token_counts_checked=True))
        for b in ranks
    ])  # fmt: skip
    assert not [o for o in out if isinstance(o, Exception)], out
    assert "header" not in regions and regions.count("map") == 4


def test_cuda_preprocess_uneven_counts_set_the_overflow_flag_with_a_budget(fake):
    ranks = _emulated_backends(2, fake)
    out = _run_threads([
        (lambda b=b: b.preprocess(_routing(7 + 3 * b.rank, 2, b.rank), pad_multiple=1,
                                  num_permuted_tokens=64))
        for b in ranks
    ])  # fmt: skip
    assert [int(h.overflow_flag) for h in out] == [1, 1], out
    even = _emulated_backends(2, fake)
    out = _run_threads([
        (lambda b=b: b.preprocess(_routing(7, 2, b.rank), pad_multiple=1, num_permuted_tokens=64))
        for b in even
    ])  # fmt: skip
    assert [int(h.overflow_flag) for h in out] == [0, 0], out


def test_fp32_is_refused_before_anything_is_copied_into_registered_memory(fake):
    """The token area holds 2-byte elements: an fp32 combine (or dispatch) must fail on its
    dtype before N*H*4 bytes are written into it, and before any barrier, so the buffer
    stays usable."""
    (b,) = _emulated_backends(1, fake)

    def tripwire(*args, **kwargs):
        raise AssertionError("registered memory or a barrier touched before the dtype check")

    b._view, b._barrier = tripwire, tripwire
    hidden = torch.zeros(4, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"16-bit hidden states.*float32.*backend='torch'"):
        b.combine(hidden, None, None)
    with pytest.raises(ValueError, match="16-bit hidden states"):
        b.dispatch(hidden, None, None)
    with pytest.raises(ValueError, match="16-bit hidden states"):
        b.unpermute_combine(hidden, None, None)


def test_a_rank_that_fails_mid_call_still_passes_every_barrier_and_its_peers_learn_it(fake):
    """Rank 0's preprocess fails between its two barriers (its read of a peer's map fails);
    rank 1's call does not hang (rank 0 passes the second barrier flagged as aborting), and
    every rank's next call raises naming rank 0 instead of using a layout rank 0 never
    finished."""
    from hybridep.backends import PeerFailed

    ranks = _emulated_backends(2, fake)

    def failing_read(*args, **kwargs):
        raise RuntimeError("hybridep CUDA memcpy from rank 1's map failed with status 700")

    ranks[0]._peer_bytes = failing_read
    out = _run_threads([
        (lambda b=b: b.preprocess(_routing(6, 2, b.rank), pad_multiple=1, num_permuted_tokens=48))
        for b in ranks
    ])  # fmt: skip
    assert isinstance(out[0], RuntimeError) and "status 700" in str(out[0]), out[0]
    assert not isinstance(out[1], Exception), out[1]
    log = ranks[0].emulated_barrier.log
    assert sorted(log) == [(0, False), (0, True), (1, False), (1, False)]
    for b in ranks:
        with pytest.raises(PeerFailed, match=r"rank 0's call failed.*close\(\) it on every rank"):
            b.preprocess(_routing(6, 2, 1), pad_multiple=1, num_permuted_tokens=48)


def test_barrier_timeout_status_fails_the_call_naming_the_missing_rank(fake):
    (b,) = _emulated_backends(1, fake)
    from hybridep import build_hybridep_abi as abi
    from hybridep.backends import BarrierTimeout

    b._status[:3] = torch.tensor([abi.STATUS_BARRIER_TIMEOUT, 3, 17], dtype=torch.int32)
    with pytest.raises(BarrierTimeout, match=r"waiting for rank 3 \(barrier epoch 17\)"):
        b.preprocess(_routing(4, 1, 0), pad_multiple=1, num_permuted_tokens=None)
    with pytest.raises(BarrierTimeout, match="barrier_timeout_s"):
        b.combine(torch.zeros(4, 16, dtype=torch.bfloat16), None, None)


class _AllocLib:
    """Records the registered-memory calls of `_allocate`, `close` and the finalizer."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def art_hybridep_alloc(self, device, total, ptr_ref):
        ptr_ref._obj.value = 0xA000
        self.calls.append(("alloc", total))
        return 0

    def art_hybridep_ipc_handle(self, device, ptr, handle):
        handle.raw = b"h" * 64
        return 0

    def art_hybridep_ipc_open(self, device, handle, ptr_ref):
        ptr_ref._obj.value = 0xB000
        self.calls.append(("ipc_open",))
        return 0

    def art_hybridep_ipc_close(self, device, ptr):
        self.calls.append(("ipc_close", ptr))
        return 0

    def art_hybridep_free(self, device, ptr):
        self.calls.append(("free", ptr))
        return 0


def _allocated_backend(monkeypatch, lib):
    from hybridep.backends import BufferSpec

    monkeypatch.setattr(backend.dist, "all_gather_object", lambda out, obj, group=None:
                        out.__setitem__(slice(None), [obj, b"p" * 64]))  # fmt: skip
    monkeypatch.setattr(backend.dist, "barrier", lambda group=None: lib.calls.append(("barrier",)))
    monkeypatch.setattr(backend.torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(backend, "_status_block", lambda: torch.zeros(4, dtype=torch.int32))
    b = object.__new__(backend.CudaBackend)
    b.group, b.rank, b.world_size, b.device = None, 0, 2, 0
    b.torch_device, b.lib, b._finalizer = torch.device("cpu"), lib, None
    b.spec = BufferSpec(hidden_dim=16, max_num_of_tokens_per_rank=8, num_local_experts=2)
    b._allocate()
    return b


def test_a_dropped_backend_releases_its_memory_locally_without_collectives(monkeypatch):
    import gc

    lib = _AllocLib()
    b = _allocated_backend(monkeypatch, lib)
    del b
    gc.collect()
    assert lib.calls[-2:] == [("ipc_close", 0xB000), ("free", 0xA000)], lib.calls
    assert ("barrier",) not in lib.calls


def test_close_is_collective_and_the_finalizer_does_not_free_twice(monkeypatch):
    import gc

    lib = _AllocLib()
    b = _allocated_backend(monkeypatch, lib)
    b.close()
    b.close()  # idempotent
    del b
    gc.collect()
    released = [c for c in lib.calls if c[0] in ("ipc_close", "free", "barrier")]
    assert released == [("barrier",), ("ipc_close", 0xB000), ("barrier",), ("free", 0xA000)]


def test_grow_reallocates_collectively_for_the_larger_size(monkeypatch):
    lib = _AllocLib()
    b = _allocated_backend(monkeypatch, lib)
    b.grow(200)
    allocs = [c[1] for c in lib.calls if c[0] == "alloc"]
    assert len(allocs) == 2 and allocs[1] > allocs[0]
    assert b.max_tokens == 256 and b.spec.max_num_of_tokens_per_rank == 200
    assert ("free", 0xA000) in lib.calls  # the old block went first
