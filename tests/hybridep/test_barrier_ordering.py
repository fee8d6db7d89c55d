"""The CUDA backend's abort barrier under the device's ordering (CPU, the compiled rule).

The first GPU run (issue 38) failed `_a_rank_fails_mid_call` of test_cuda_backend.py: rank 0's
dispatch launch was refused after its first barrier; instead of every rank's next call raising
`PeerFailed`, rank 0's raised `BarrierTimeout` (barrier epoch 4, waiting for rank 1) after the
timeout. The cause: rank 1's context reached barrier 3 first and spun; rank 0's context passed
barrier 3 and, in the same time slice, posted barrier 4 with the abort bit; rank 1 then read
4|abort while still in barrier 3 and took the abort as this barrier's, recorded PEER_FAILED
early, skipped its barrier 4 without posting (a failed status short-circuits), and rank 0 waited
for it until the timeout. The thread emulation in test_cuda_binding.py blocks each host at
each barrier, so it cannot produce that schedule; `support.emulated_gpu` can (see there), and
runs the arrival rule compiled from csrc/hybridep/intranode.cu.
"""

from __future__ import annotations

import ctypes
import shutil
from types import SimpleNamespace

import pytest
import torch
from support.emulated_gpu import ABORT_BIT, ABORTED, PASSED, WAIT, EmulatedGpu

from hybridep import build as kb
from hybridep import build_hybridep_abi as abi
from hybridep.backends import BarrierTimeout, BufferSpec, PeerFailed
from hybridep.backends import cuda as backend

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc on PATH")
REFUSED = 10002  # what a refused launch returns (ART_ERR_BAD_ARGUMENT)


@pytest.fixture(scope="session")
def kernel_config(tmp_path_factory):
    """The same session cache directory as test_build_kernels.py: each library builds once."""
    return kb.BuildConfig(cache_dir=tmp_path_factory.getbasetemp() / "kernel-cache")


@pytest.fixture(scope="session")
def arrival_rule(kernel_config):
    """The barrier's arrival rule as compiled (a host-callable entry point; no GPU call)."""
    built = kb.build(abi.library_spec(), kernel_config)
    lib = abi._declare(ctypes.CDLL(str(built.path)))
    return lib.art_hybridep_barrier_arrival


def test_the_compiled_rule_takes_an_abort_only_at_its_own_barrier(arrival_rule):
    target = 7
    assert arrival_rule(target - 1, target) == WAIT
    assert arrival_rule((target - 1) | ABORT_BIT, target) == WAIT
    assert arrival_rule(target, target) == PASSED
    assert arrival_rule(target | ABORT_BIT, target) == ABORTED
    # the peer already posted the next barrier: it passed this one; its abort is the next's
    assert arrival_rule(target + 1, target) == PASSED
    assert arrival_rule((target + 1) | ABORT_BIT, target) == PASSED


class _Launches:
    """The library as `_push` sees it: a launch queues a kernel on the emulated stream and
    returns, or is refused (what the GPU run did to rank 0)."""

    def __init__(self, gpu: EmulatedGpu, rank: int, refuse: bool) -> None:
        self.gpu, self.rank, self.refuse = gpu, rank, refuse

    def art_hybridep_dispatch(self, params) -> int:
        if self.refuse:
            return REFUSED
        self.gpu.launch_kernel(self.rank, "dispatch")
        return 0


def _backends(gpu: EmulatedGpu, failing: int):
    spec = BufferSpec(hidden_dim=16, max_num_of_tokens_per_rank=8, num_local_experts=2)
    ranks = []
    for rank in range(gpu.world):
        b = object.__new__(backend.CudaBackend)
        b.spec, b.rank, b.world_size, b.device = spec, rank, gpu.world, 0
        b.torch_device, b._closed, b._status = torch.device("cpu"), False, gpu.statuses[rank]
        b.lib = _Launches(gpu, rank, refuse=rank == failing)
        b._barrier = lambda abort=False, r=rank: gpu.launch_barrier(r, abort)
        b._intra = lambda *args: ctypes.c_int(0)  # a params block the stand-in never reads
        b._view = lambda region, n: torch.zeros(n, dtype=torch.uint8)
        ranks.append(b)
    return ranks


def _dispatch(b) -> Exception | None:
    """The real `CudaBackend.dispatch` (its `_push`: barrier, launch, barrier) on one rank."""
    handle = SimpleNamespace(num_recv_rows=4, hidden_dim=16, num_experts_per_rank=2)
    try:
        b.dispatch(torch.zeros(4, 16, dtype=torch.bfloat16), torch.zeros(4, 4), handle)
    except RuntimeError as exc:
        return exc
    return None


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("first", ["a peer", "the failing rank"])
def test_a_refused_launch_makes_every_rank_raise_peer_failed_whoever_spins_first(
    arrival_rule, world, first
):
    """Rank 0's dispatch launch is refused after its first barrier (the GPU run's case), with
    both orders of the contexts: a peer's context gets the GPU first and spins at the first
    barrier while rank 0 passes it and posts its abort in one slice (the order that failed on
    the GPU), or rank 0's does. Every rank's next call raises PeerFailed naming rank 0 at the
    barrier it aborted (epoch 4, as on the GPU: barriers 1 and 2 are a previous call's); none
    waits out the timeout."""
    gpu = EmulatedGpu(world, arrival_rule)
    ranks = _backends(gpu, failing=0)
    for b in ranks:  # a previous call: every rank passes barriers 1 and 2
        gpu.launch_barrier(b.rank, False)
        gpu.launch_barrier(b.rank, False)
    gpu.synchronize()
    order = [*range(1, world), 0] if first == "a peer" else list(range(world))
    for rank in order:  # each host queues its call; its context then gets a slice
        outcome = _dispatch(ranks[rank])
        assert (outcome is not None) == (rank == 0), outcome
        gpu.run(rank)
    gpu.synchronize()  # torch.cuda.synchronize() on every rank
    assert gpu.launches.count((0, "abort barrier")) == 1
    for b in ranks:
        with pytest.raises(PeerFailed, match=r"rank 0's call failed.* at barrier epoch 4"):
            b.check_status()


def test_a_rank_that_never_arrives_still_times_out_naming_it(arrival_rule):
    """The rule change keeps the timeout: rank 1 never launches its barrier, rank 0's
    barrier gives up naming rank 1, and the next call raises BarrierTimeout."""
    gpu = EmulatedGpu(2, arrival_rule)
    ranks = _backends(gpu, failing=-1)
    gpu.launch_barrier(0, False)
    gpu.synchronize()
    with pytest.raises(BarrierTimeout, match=r"waiting for rank 1 \(barrier epoch 1\)"):
        ranks[0].check_status()
    ranks[1].check_status()  # the absent rank recorded nothing
