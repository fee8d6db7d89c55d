"""The CUDA HybridEP backend: refusals on CPU; on an sm_90 GPU, bitwise equality with the
reference semantics.

CPU (always): no GPU -> `BackendUnavailable` naming the reason (never a silent fallback); a
group spanning hosts is refused; the kernels' compile + C ABI are checked in
test_build_kernels.py and the struct layouts in test_cuda_abi_layout.py.
GPU (sm_90 only): (a) the scan, permute and unpermute kernels on one GPU against
`hybridep.layout` / `hybridep.movement`, emulating rank k of W; (b) 2 and 4 rank processes on
one GPU (gloo group, CUDA IPC) running preprocess -> dispatch -> permute -> unpermute ->
combine against the torch backend on the same inputs. All comparisons are bitwise. The same
spawn covers zero tokens on every rank, a rank nothing is routed to, uneven token counts
(blocking raises on every rank, a budget sets the flag), an fp32 combine refused without
harming the buffer, growth, and a barrier that times out on a late rank without killing the
process (its CPU twins are in test_cuda_binding.py and test_kernels_zero_rows_abi.py).
"""

from __future__ import annotations

import pytest
import torch
from support.dist import run_ranks

from hybridep.backends import BackendUnavailable, BufferSpec, select_backend
from hybridep.backends.cuda import CudaBackend, check_single_node

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def gpu(test):
    """`gpu`-marked (bench/gpu_check.sh selects these) and skipped without an sm_90 GPU."""
    return pytest.mark.gpu(
        pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU")(test)
    )


# -- CPU: refusals ------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_cuda_backend_is_refused_without_a_gpu_naming_the_reason():
    assert "no CUDA device" in CudaBackend.unavailable_reason(None)
    with pytest.raises(BackendUnavailable, match="no CUDA device"):
        CudaBackend(None, BufferSpec(hidden_dim=8, max_num_of_tokens_per_rank=4,
                                     num_local_experts=2))  # fmt: skip
    with pytest.raises(BackendUnavailable, match="cannot run"):
        select_backend("cuda", None)


def test_group_spanning_hosts_is_refused():
    with pytest.raises(BackendUnavailable, match=r"spans 2 hosts \['a', 'b'\].*backend='torch'"):
        check_single_node(["a", "b", "a"])
    check_single_node(["a", "a", "a"])  # one node: accepted


# -- GPU (a): single-GPU kernels against the pure reference functions -----------------------
def _random_map(world, tokens, num_local, seed, density=0.3):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(world, tokens, world * num_local, generator=gen) < density


@gpu
@pytest.mark.parametrize("world,tokens,num_local", [(1, 33, 4), (2, 700, 3), (4, 1500, 8)])
@pytest.mark.parametrize("pad,budget", [(1, None), (16, None), (4, 64), (1, 10**6)])
def test_layout_kernels_match_reference(world, tokens, num_local, pad, budget):
    from hybridep import build_hybridep_abi as abi
    from hybridep import layout
    from hybridep.backends.cuda import compute_layout

    lib = abi.load_library()
    gmap = _random_map(world, tokens, num_local, seed=world * tokens + pad)
    need = layout.rank_need(gmap, num_local)
    for rank in range(world):
        got = compute_layout(lib, gmap.cuda(), rank, num_local, pad, budget)
        ref = layout.expert_positions(layout.local_expert_map(gmap, rank, num_local), pad, budget)
        sparse = (layout.sparse_to_dense_compact(need, rank) if budget is None
                  else layout.sparse_to_dense_slots(need[rank], rank))  # fmt: skip
        assert torch.equal(got["need"].cpu().bool(), need.reshape(world * tokens, world))
        assert torch.equal(got["sparse_to_dense"].cpu(), sparse)
        assert torch.equal(got["positions"].cpu(), ref.positions.to(torch.int32))
        assert torch.equal(got["tokens_per_expert"].cpu(), ref.tokens_per_expert)
        assert torch.equal(got["overflow_flag"].cpu(), ref.overflow_flag)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hidden", [256, 7168, 12])
def test_permute_and_unpermute_kernels_match_reference(dtype, hidden):
    from hybridep import build_hybridep_abi as abi
    from hybridep import layout, movement
    from hybridep.backends.cuda import permute_rows, unpermute_rows

    lib = abi.load_library()
    world, tokens, num_local, pad = 2, 300, 4, 8
    gmap = _random_map(world, tokens, num_local, seed=hidden)
    positions = layout.expert_positions(layout.local_expert_map(gmap, 1, num_local), pad, None)
    m = int(positions.tokens_per_expert.sum())
    recv = torch.randn(world * tokens, hidden).to(dtype)
    recv_probs = torch.rand(world * tokens, num_local)
    ref_tokens, ref_probs = movement.permute_tokens(recv, recv_probs, positions.positions, m)
    pos32 = positions.positions.to(torch.int32).cuda()
    got_tokens, got_probs = permute_rows(lib, recv.cuda(), recv_probs.cuda(), pos32, m)
    assert torch.equal(got_tokens.cpu(), ref_tokens) and torch.equal(got_probs.cpu(), ref_probs)
    expert_out = torch.randn(m, hidden).to(dtype)  # any values: same fp32 order, one rounding
    out_probs = torch.rand(m)
    ref_back, ref_back_probs = movement.unpermute_tokens(expert_out, out_probs, positions.positions)
    got_back, got_back_probs = unpermute_rows(lib, expert_out.cuda(), out_probs.cuda(), pos32)
    assert torch.equal(got_back.cpu(), ref_back)
    assert torch.equal(got_back_probs.cpu(), ref_back_probs)


@gpu
def test_permute_and_unpermute_kernels_with_zero_rows_and_zero_budget():
    from hybridep import build_hybridep_abi as abi
    from hybridep.backends.cuda import permute_rows, unpermute_rows

    lib = abi.load_library()
    empty = torch.zeros(0, 64, dtype=torch.bfloat16, device="cuda")
    no_positions = torch.zeros(0, 3, dtype=torch.int32, device="cuda")
    tokens, probs = permute_rows(lib, empty, torch.zeros(0, 3, device="cuda"), no_positions, 8)
    assert tokens.shape == (8, 64) and not tokens.any() and not probs.any()
    tokens, probs = permute_rows(lib, empty, None, no_positions, 0)
    assert tokens.shape == (0, 64) and probs is None
    dropped = torch.full((5, 3), -1, dtype=torch.int32, device="cuda")  # budget 0: all dropped
    recv, recv_probs = unpermute_rows(lib, empty, torch.zeros(0, device="cuda"), dropped)
    assert recv.shape == (5, 64) and not recv.any() and not recv_probs.any()


@gpu
def test_unpermute_kernel_takes_a_misaligned_base_pointer():
    """Rows of 64 bf16 (16-byte pitch) read from a view one element into a buffer: the base is
    2-byte aligned, so the kernel must not use 16-byte loads (it did: misaligned address)."""
    from hybridep import build_hybridep_abi as abi
    from hybridep import layout, movement
    from hybridep.backends.cuda import unpermute_rows

    lib = abi.load_library()
    gmap = _random_map(2, 50, 3, seed=4)
    positions = layout.expert_positions(layout.local_expert_map(gmap, 0, 3), 1, None)
    m = int(positions.tokens_per_expert.sum())
    backing = torch.randn(m * 64 + 1).to(torch.bfloat16)
    expert_out = backing[1:].view(m, 64)  # not 16-byte aligned
    ref, _ = movement.unpermute_tokens(expert_out, None, positions.positions)
    pos32 = positions.positions.to(torch.int32).cuda()
    got, _ = unpermute_rows(lib, backing.cuda()[1:].view(m, 64), None, pos32)
    assert torch.equal(got.cpu(), ref)


# -- GPU (b): 2-4 rank processes on one GPU through CUDA IPC --------------------------------
HIDDEN, LOCAL, TOKENS = 256, 3, 200


def _ipc_worker(rank: int, world: int, seed: int) -> dict:
    import torch.distributed as dist

    from hybridep.backends.cuda import CudaBackend
    from hybridep.backends.torch_ref import TorchBackend

    torch.cuda.set_device(0)  # every rank on the same GPU
    spec = BufferSpec(hidden_dim=HIDDEN, max_num_of_tokens_per_rank=TOKENS, num_local_experts=LOCAL)
    ref, cuda = TorchBackend(dist.group.WORLD, spec), CudaBackend(dist.group.WORLD, spec)
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    experts = world * LOCAL
    routing = torch.rand(TOKENS, experts, generator=gen) < 0.25
    hidden = torch.randint(-8, 9, (TOKENS, HIDDEN), generator=gen).to(torch.bfloat16)
    probs = torch.rand(TOKENS, experts, generator=gen) * routing
    out = {}
    for mode, pad, budget in (("blocking", 1, None), ("padded", 16, None), ("budget", 4, 96)):
        h_ref = ref.preprocess(routing, pad_multiple=pad, num_permuted_tokens=budget)
        h_gpu = cuda.preprocess(routing.cuda(), pad_multiple=pad, num_permuted_tokens=budget)
        same = lambda a, b: torch.equal(a.cpu(), b.cpu())  # noqa: E731
        out[f"{mode}/handle"] = (
            h_ref.num_recv_rows == h_gpu.num_recv_rows
            and h_ref.num_permuted_tokens == h_gpu.num_permuted_tokens
            and h_ref.send_counts == h_gpu.send_counts and h_ref.recv_counts == h_gpu.recv_counts
            and same(h_ref.sparse_to_dense_map, h_gpu.sparse_to_dense_map)
            and same(h_ref.dense_to_expert_map, h_gpu.dense_to_expert_map)
            and same(h_ref.tokens_per_expert, h_gpu.tokens_per_expert)
            and same(h_ref.overflow_flag, h_gpu.overflow_flag)
        )  # fmt: skip
        r_ref = ref.dispatch(hidden, probs, h_ref)
        r_gpu = cuda.dispatch(hidden.cuda(), probs.cuda(), h_gpu)
        out[f"{mode}/dispatch"] = same(r_ref[0], r_gpu[0]) and same(r_ref[1], r_gpu[1])
        p_ref = ref.permute(*r_ref, h_ref)
        p_gpu = cuda.permute(*r_gpu, h_gpu)
        out[f"{mode}/permute"] = same(p_ref[0], p_gpu[0]) and same(p_ref[1], p_gpu[1])
        u_ref = ref.unpermute(p_ref[0] * 3, p_ref[1], h_ref)  # "experts" that triple the row
        u_gpu = cuda.unpermute(p_gpu[0] * 3, p_gpu[1], h_gpu)
        out[f"{mode}/unpermute"] = same(u_ref[0], u_gpu[0]) and same(u_ref[1], u_gpu[1])
        c_ref = ref.combine(*u_ref, h_ref)
        c_gpu = cuda.combine(*u_gpu, h_gpu)
        out[f"{mode}/combine"] = same(c_ref[0], c_gpu[0]) and same(c_ref[1], c_gpu[1])
        # the fused paths Buffer takes: permute straight from the registered area,
        # unpermute straight into it (no clone, no staging copy), same bits
        f_gpu = cuda.dispatch_permute(hidden.cuda(), probs.cuda(), h_gpu)
        out[f"{mode}/dispatch_permute"] = same(p_ref[0], f_gpu[0]) and same(p_ref[1], f_gpu[1])
        b_gpu = cuda.unpermute_combine(f_gpu[0] * 3, f_gpu[1], h_gpu)
        out[f"{mode}/unpermute_combine"] = same(c_ref[0], b_gpu[0]) and same(c_ref[1], b_gpu[1])
    out.update(_edge_cases(rank, world, ref, cuda, routing, hidden, probs))
    cuda.close()
    out.update(_a_rank_fails_mid_call(rank, spec, routing, hidden, probs))
    return out


def _a_rank_fails_mid_call(rank, spec, routing, hidden, probs) -> dict:
    """Rank 0's dispatch fails after its first barrier (the kernel launch is refused); its
    peers' dispatch returns well inside barrier_timeout_s (rank 0 passed the second barrier,
    flagged), and every rank's next call raises PeerFailed naming rank 0."""
    import dataclasses
    import time

    import torch.distributed as dist

    from hybridep.backends import PeerFailed
    from hybridep.backends.cuda import CudaBackend

    spec = dataclasses.replace(
        spec, config=dataclasses.replace(spec.config, barrier_timeout_s=20.0)
    )
    cuda = CudaBackend(dist.group.WORLD, spec)
    handle = cuda.preprocess(routing.cuda(), pad_multiple=1, num_permuted_tokens=None)
    if rank == 0:
        real = cuda.lib

        class RefusingLaunch:
            def __getattr__(self, name):
                if name == "art_hybridep_dispatch":
                    return lambda params: 10002  # what a refused launch returns
                return getattr(real, name)

        cuda.lib = RefusingLaunch()
    out = {}
    dist.barrier()
    t0 = time.monotonic()
    try:
        cuda.dispatch(hidden.cuda(), probs.cuda(), handle)
        out["abort/raised_on_rank_0"] = rank != 0
    except RuntimeError as exc:
        out["abort/raised_on_rank_0"] = rank == 0 and "dispatch failed" in str(exc)
    torch.cuda.synchronize()
    out["abort/peers_did_not_wait"] = time.monotonic() - t0 < 10.0
    if rank == 0:
        cuda.lib = real
    try:
        cuda.preprocess(routing.cuda(), pad_multiple=1, num_permuted_tokens=None)
        out["abort/next_call_raises"] = False
    except PeerFailed as exc:
        out["abort/next_call_raises"] = "rank 0's call failed" in str(exc)
    cuda.close()
    return out


def _edge_cases(rank, world, ref, cuda, routing, hidden, probs) -> dict:
    """Zero tokens, a rank with nothing routed to it, uneven counts, fp32, growth, timeout."""
    from hybridep.backends import BarrierTimeout

    same = lambda a, b: torch.equal(a.cpu(), b.cpu())  # noqa: E731
    out = {}

    def round_trip(backend, r, h, p, budget=None, dev=lambda t: t):
        handle = backend.preprocess(dev(r), pad_multiple=4, num_permuted_tokens=budget)
        recv = backend.dispatch(dev(h), dev(p), handle)
        perm = backend.permute(*recv, handle)
        back = backend.unpermute(perm[0] * 2, perm[1], handle)
        return handle, perm, backend.combine(*back, handle)

    gpu_ = lambda t: t.cuda()  # noqa: E731
    for name, r, h, p in (
        ("zero_tokens", routing[:0], hidden[:0], probs[:0]),
        ("last_rank_idle", routing & (torch.arange(routing.shape[1]) < (world - 1) * LOCAL),
         hidden, probs),
    ):  # fmt: skip
        for budget in (None, 64):
            h_ref, p_ref, c_ref = round_trip(ref, r, h, p, budget)
            h_gpu, p_gpu, c_gpu = round_trip(cuda, r, h, p, budget, gpu_)
            out[f"{name}/{budget}"] = (
                same(p_ref[0], p_gpu[0]) and same(c_ref[0], c_gpu[0])
                and same(c_ref[1], c_gpu[1]) and same(h_ref.overflow_flag, h_gpu.overflow_flag)
            )  # fmt: skip
    short = TOKENS - 10 * rank  # uneven counts
    try:
        cuda.preprocess(routing[:short].cuda(), pad_multiple=1, num_permuted_tokens=None)
        out["uneven_blocking_raises"] = False
    except ValueError as exc:
        out["uneven_blocking_raises"] = "different token counts" in str(exc)
    handle = cuda.preprocess(routing[:short].cuda(), pad_multiple=1, num_permuted_tokens=512)
    out["uneven_static_flag"] = int(handle.overflow_flag.item()) == 1
    handle = cuda.preprocess(routing.cuda(), pad_multiple=1, num_permuted_tokens=None)
    recv = cuda.dispatch(hidden.cuda(), None, handle)
    try:
        cuda.combine(recv[0].float(), None, handle)
        out["fp32_refused"] = False
    except ValueError:
        out["fp32_refused"] = True
    c_gpu = cuda.combine(recv[0], None, handle)  # the buffer still works after the refusal
    h_ref = ref.preprocess(routing, pad_multiple=1, num_permuted_tokens=None)
    c_ref = ref.combine(ref.dispatch(hidden, None, h_ref)[0], None, h_ref)
    out["after_fp32_bitwise"] = same(c_ref[0], c_gpu[0])
    # growth: twice the tokens after a collective reallocation
    cuda.grow(2 * TOKENS)
    ref.grow(2 * TOKENS)
    big = [torch.cat([t, t]) for t in (routing, hidden, probs)]
    _, p_ref, c_ref = round_trip(ref, *big)
    _, p_gpu, c_gpu = round_trip(cuda, *big, dev=gpu_)
    out["grown_bitwise"] = same(p_ref[0], p_gpu[0]) and same(c_ref[0], c_gpu[0])
    # a late rank: the others' barrier gives up, the call fails naming it, the process lives
    import dataclasses
    import time

    import torch.distributed as dist

    cuda.spec = dataclasses.replace(
        cuda.spec, config=dataclasses.replace(cuda.spec.config, barrier_timeout_s=1.0)
    )
    dist.barrier()
    if rank == world - 1:
        time.sleep(4.0)
    else:
        try:
            cuda.preprocess(routing.cuda(), pad_multiple=1, num_permuted_tokens=None)
            out["timeout_named"] = False
        except BarrierTimeout as exc:
            out["timeout_named"] = f"waiting for rank {world - 1}" in str(exc)
        torch.cuda.synchronize()  # the CUDA context survived
        out["context_alive"] = bool(torch.ones(1, device="cuda").sum().item() == 1)
    return out


@gpu
@pytest.mark.parametrize("world", [2, 4])
def test_ipc_ranks_on_one_gpu_match_torch_backend_bitwise(world):
    from hybridep import build_hybridep_abi as abi

    abi.load_library()  # build once in the parent; the ranks load the cached library
    results = run_ranks(_ipc_worker, world_size=world, args=(world,), timeout_s=300)
    failed = {f"rank{r}/{k}" for r, res in enumerate(results) for k, ok in res.items() if not ok}
    assert not failed, sorted(failed)
