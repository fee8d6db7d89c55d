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
        if p.recv_probs:
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
        if p.probs:
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
