"""The compiled libraries' C entry points with zero rows, called for real on CPU (ctypes).

PyTorch hands out null data pointers for 0-byte CUDA tensors, so a rank whose experts got no
token (or with no token at all) calls every kernel entry point with null row pointers. Such a
call must be accepted and, when there is nothing to write, return ART_OK before touching the
device: on this GPU-less machine that is observable (any device call returns a CUDA error),
so these tests load the very libraries the GPU runs and call them. Calls that do have device
work at zero rows (the layout's counts, wgrad's dW = 0) are checked to get past the argument
check (a CUDA error here, not ART_ERR_BAD_ARGUMENT). The GPU twins (real launches with zero
rows) are in test_cuda_backend.py and tests/art_megatron_ext/ops/test_grouped_gemm_cutlass.py.
"""

from __future__ import annotations

import ctypes
import shutil

import pytest
import torch

from hybridep import build as kb
from hybridep import build_hybridep_abi as abi

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc on PATH")
OK, BAD_ARGUMENT = 0, 10002
NO_GPU = not torch.cuda.is_available()


@pytest.fixture(scope="session")
def kernel_config(tmp_path_factory):
    """The same session cache directory as test_build_kernels.py: each library builds once."""
    return kb.BuildConfig(cache_dir=tmp_path_factory.getbasetemp() / "kernel-cache")


@pytest.fixture(scope="session")
def hep(kernel_config):
    built = kb.build(abi.library_spec(), kernel_config)
    return abi._declare(ctypes.CDLL(str(built.path)))  # only calls that never reach the GPU


def _permute(**kw):
    base = dict(hidden_dim=16, num_local_experts=2, dtype=0, device=0)
    return abi.PermuteParams.make(**{**base, **kw})


def _intra(**kw):
    base = dict(world_size=2, rank=0, num_local_experts=2, hidden_dim=16, dtype=0)
    return abi.IntraParams.make(**{**base, **kw})


def test_permute_with_no_permuted_row_returns_ok_with_null_pointers(hep):
    # N = 0 receive rows and M = 0 rows (a rank nothing was routed to), probs requested
    p = _permute(num_recv_rows=0, num_permuted=0, with_probs=1)
    assert hep.art_hybridep_permute(ctypes.byref(p)) == OK


def test_unpermute_with_no_receive_row_returns_ok_with_null_pointers(hep):
    p = _permute(num_recv_rows=0, num_permuted=0, with_probs=1)
    assert hep.art_hybridep_unpermute(ctypes.byref(p)) == OK
    # M > 0 permuted rows still need their tokens pointer: refused
    q = _permute(num_recv_rows=0, num_permuted=4, with_probs=0)
    assert hep.art_hybridep_unpermute(ctypes.byref(q)) == BAD_ARGUMENT


def test_probs_are_an_explicit_flag_not_inferred_from_null_pointers(hep):
    """M = 8 budget rows but N = 0 receive rows: recv_probs is empty (null) while probs is
    not; ABI 1 refused this as 'both or neither'. Now it gets past the checks (to the device:
    a CUDA error on this machine)."""
    p = _permute(num_recv_rows=0, num_permuted=8, with_probs=1, tokens=0x1000, probs=0x2000,
                 source=0x3000)  # fmt: skip
    status = hep.art_hybridep_permute(ctypes.byref(p))
    assert status != BAD_ARGUMENT
    if NO_GPU:
        assert status != OK  # it did try the device
    missing = _permute(
        num_recv_rows=4,
        num_permuted=8,
        with_probs=1,
        tokens=0x1000,
        probs=0x2000,
        source=0x3000,
        positions=0x4000,
        recv_hidden=0x5000,
    )
    assert hep.art_hybridep_permute(ctypes.byref(missing)) == BAD_ARGUMENT  # recv_probs null


@pytest.mark.parametrize("entry", ["art_hybridep_dispatch", "art_hybridep_combine"])
def test_dispatch_and_combine_with_no_token_return_ok_with_null_pointers(hep, entry):
    p = _intra(num_tokens=0, with_probs=1)  # sparse_to_dense, hidden, probs: all empty
    assert getattr(hep, entry)(ctypes.byref(p)) == OK
    q = _intra(num_tokens=3, with_probs=0)  # tokens but no arrays: refused
    assert getattr(hep, entry)(ctypes.byref(q)) == BAD_ARGUMENT


def test_layout_with_no_token_gets_past_the_checks_with_null_maps(hep):
    """T = 0: the maps are empty (null) but counts and the flag must still be written."""
    p = abi.LayoutParams.make(world_size=2, rank=1, num_tokens=0, num_local_experts=2,
                              pad_multiple=1, budget=-1, tokens_per_expert=0x1000,
                              overflow_flag=0x2000, scratch=0x3000)  # fmt: skip
    status = hep.art_hybridep_preprocess(ctypes.byref(p))
    assert status != BAD_ARGUMENT
    if NO_GPU:
        assert status != OK
    p.num_tokens = 5  # with tokens the maps are required
    assert hep.art_hybridep_preprocess(ctypes.byref(p)) == BAD_ARGUMENT


def test_unpermute_vector_width_checks_base_pointers_not_only_the_width(hep):
    """16-byte loads need H*elt % 16 == 0 *and* 16-byte aligned bases (a view at row offset
    1 of a bf16 tensor with H=12 is 8-byte aligned)."""
    width = hep.art_hybridep_vector_width
    assert width(0, 64, 0x1000, 0x2000) == 8  # bf16, aligned: 8 lanes of 2 bytes
    assert width(2, 64, 0x1000, 0x2000) == 4  # fp32
    assert width(0, 64, 0x1008, 0x2000) == 1  # tokens base misaligned
    assert width(0, 64, 0x1000, 0x2002) == 1  # receive base misaligned
    assert width(0, 12, 0x1000, 0x2000) == 1  # 24-byte rows
    assert width(7, 64, 0x1000, 0x2000) == 0  # unknown dtype


def test_barrier_requires_its_status_block_and_a_timeout(hep):
    good = dict(world_size=2, rank=1, arrivals=0x1000, epoch=0x2000, status=0x3000,
                timeout_ns=10**9)  # fmt: skip
    for bad in ({"timeout_ns": 0}, {"status": None}, {"rank": 2}, {"arrivals": None}):
        p = abi.BarrierParams.make(**{**good, **bad})
        assert hep.art_hybridep_barrier(ctypes.byref(p)) == BAD_ARGUMENT, bad


# -- grouped GEMM ---------------------------------------------------------------------------
# The first test to use `gg` builds the CUTLASS library (about 2 min on a quiet 2-core box,
# 10-20 min on a loaded one), unless test_build_kernels.py built it earlier in the session.
CUTLASS_BUILD = pytest.mark.timeout(2400)


@pytest.fixture(scope="session")
def gg(kernel_config):
    from art_megatron_ext.ops import cutlass_grouped_gemm as cg

    built = kb.build(cg.library_spec(), kernel_config)
    lib = ctypes.CDLL(str(built.path))
    for name in ("fwd", "dgrad", "wgrad"):
        getattr(lib, f"art_grouped_gemm_{name}").argtypes = [ctypes.POINTER(cg.GroupedGemmParams)]
    return lib


def _gg_params(**kw):
    from art_megatron_ext.ops import cutlass_grouped_gemm as cg

    fields = dict(abi_version=cg.ABI_VERSION, struct_size=ctypes.sizeof(cg.GroupedGemmParams),
                  num_groups=4, config=-1, total_rows=0, k=64, n=32)  # fmt: skip
    return cg.GroupedGemmParams(**{**fields, **kw})


@CUTLASS_BUILD
@pytest.mark.parametrize("op", ["fwd", "dgrad"])
def test_grouped_gemm_with_no_row_returns_ok_with_null_pointers(gg, op):
    """Every expert of the rank got no token: x and out are 0-byte (null), weights are not."""
    p = _gg_params(b=0x1000)
    assert getattr(gg, f"art_grouped_gemm_{op}")(ctypes.byref(p)) == OK


@CUTLASS_BUILD
def test_grouped_gemm_wgrad_with_no_row_zeroes_dw_without_row_pointers(gg):
    """dW = 0 still has to be written, so the call reaches the device; x, dY, group_end and
    the workspace may all be null (ABI 1 refused this as a bad argument)."""
    p = _gg_params(out=0x1000)
    status = gg.art_grouped_gemm_wgrad(ctypes.byref(p))
    assert status != BAD_ARGUMENT
    if NO_GPU:
        assert status != OK
    assert gg.art_grouped_gemm_wgrad(ctypes.byref(_gg_params())) == BAD_ARGUMENT  # dW null
