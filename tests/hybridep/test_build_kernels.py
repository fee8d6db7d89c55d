"""CI compiles every kernel library of csrc/ with nvcc and checks its C ABI (no GPU needed).

One session-wide cache directory (under pytest's base temp) is shared with the GPU tests, so
each library compiles once per session (grouped GEMM ~2.5 min, HybridEP a few seconds here).
"""

from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path

import pytest

from hybridep import build as kb

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc on PATH")


@pytest.fixture(scope="session")
def kernel_config(tmp_path_factory):
    """A session cache; `ART_TEST_KERNEL_CACHE` names a persistent one for local reruns (the
    CUTLASS build takes minutes on a loaded box, and the cache checks its own validity)."""
    persistent = os.environ.get("ART_TEST_KERNEL_CACHE")
    if persistent:
        return kb.BuildConfig(cache_dir=Path(persistent))
    return kb.BuildConfig(cache_dir=tmp_path_factory.getbasetemp() / "kernel-cache")


@pytest.fixture(scope="session")
def grouped_gemm_lib(kernel_config):
    from art_megatron_ext.ops import cutlass_grouped_gemm as cg

    return kb.build(cg.library_spec(), kernel_config)


def test_grouped_gemm_library_exports_its_c_abi(grouped_gemm_lib):
    from art_megatron_ext.ops import cutlass_grouped_gemm as cg

    symbols = kb.exported_symbols(grouped_gemm_lib.path)
    assert set(cg.SYMBOLS) <= symbols
    assert not [s for s in symbols if "cutlass" in s.lower()], "CUTLASS internals exported"


def _cuobjdump() -> str | None:
    """`cuobjdump` from the toolkit, or the one Triton's wheel carries (CI has the latter)."""
    import importlib.util
    from pathlib import Path

    found = shutil.which("cuobjdump")
    spec = importlib.util.find_spec("triton")
    if found is None and spec is not None and spec.origin is not None:
        candidate = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        found = str(candidate) if candidate.exists() else None
    return found


def _cuobjdump_output(flag: str, library) -> str:
    """`cuobjdump FLAG LIBRARY`'s output; skips when no cuobjdump exists here."""
    import subprocess

    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (neither the CUDA toolkit's nor Triton's)")
    return subprocess.run(
        [tool, flag, str(library)], capture_output=True, text=True, check=True
    ).stdout


def test_grouped_gemm_sass_uses_wgmma_and_tma_without_spills(grouped_gemm_lib):
    """The kernels are on Hopper's fast path: HGMMA (wgmma) and TMA loads, no HMMA fallback,
    no local-memory spills (LDL/STL)."""
    import re

    sass = _cuobjdump_output("--dump-sass", grouped_gemm_lib.path)
    assert len(re.findall(r"\bHGMMA\.", sass)) >= 16
    assert "UTMALDG" in sass
    assert not re.search(r"\bHMMA\.", sass)
    assert not re.search(r"\b(LDL|STL)\b", sass)


def _raw(built):
    """Load without the arch check: only functions that never touch the GPU are called."""
    return ctypes.CDLL(str(built.path))


def test_grouped_gemm_abi_checks_run_without_a_gpu(grouped_gemm_lib):
    from art_megatron_ext.ops import cutlass_grouped_gemm as cg

    lib = _raw(grouped_gemm_lib)
    lib.art_grouped_gemm_abi_version.restype = ctypes.c_uint32
    assert lib.art_grouped_gemm_abi_version() == cg.ABI_VERSION

    def pick(**kw):
        fields = dict(abi_version=cg.ABI_VERSION, struct_size=ctypes.sizeof(cg.GroupedGemmParams))
        fields.update(num_groups=128, config=-1, total_rows=65536, k=2048, n=1536)
        fields.update(kw)
        out = ctypes.c_int32(-7)
        status = lib.art_grouped_gemm_pick_config(
            ctypes.byref(cg.GroupedGemmParams(**fields)), ctypes.byref(out)
        )
        return status, out.value

    assert pick() == (0, 0)  # 512 rows per expert: cooperative 256x128
    assert pick(total_rows=128 * 64) == (0, 1)  # 64 rows per expert: ping-pong 128x128
    assert pick(config=1) == (0, 1)  # an explicit config is kept
    assert pick(k=2044)[0] == 10002  # K not a multiple of 8: bad argument
    assert pick(num_groups=0)[0] == 10002
    assert pick(config=5)[0] == 10002
    assert pick(abi_version=99)[0] == 10001  # stale caller: refused before anything runs
    assert pick(struct_size=8)[0] == 10001


def test_grouped_gemm_library_is_refused_for_another_arch(grouped_gemm_lib):
    with pytest.raises(kb.KernelArchMismatch, match="built for sm_90a"):
        kb.load(grouped_gemm_lib, current_arch="sm_100a")


@pytest.fixture(scope="session")
def hybridep_lib(kernel_config):
    from hybridep import build_hybridep_abi as abi

    return kb.build(abi.library_spec(), kernel_config)


def test_cuda_backend_accepts_a_cached_library_without_nvcc(
    hybridep_lib, kernel_config, tmp_path, monkeypatch
):
    """The CUDA backend's availability check: with nvcc absent a valid cached HybridEP library
    is enough (it loads without nvcc); an empty cache is refused naming nvcc and the cache.
    The GPU itself is absent here, so only its presence and arch are stood in for."""
    import torch

    from hybridep.backends import cuda as cuda_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kb, "device_arch", lambda: kb.SM90A)
    monkeypatch.setattr(cuda_backend.shutil, "which", lambda name: None)
    assert cuda_backend.CudaBackend.unavailable_reason(None, kernel_config) is None
    empty = kb.BuildConfig(cache_dir=tmp_path / "empty-cache")
    reason = cuda_backend.CudaBackend.unavailable_reason(None, empty)
    assert reason is not None and "nvcc is not on PATH" in reason and "cache" in reason


def test_hybridep_library_exports_its_c_abi(hybridep_lib):
    from hybridep import build_hybridep_abi as abi

    assert set(abi.SYMBOLS) <= kb.exported_symbols(hybridep_lib.path)


def test_hybridep_abi_checks_run_without_a_gpu(hybridep_lib):
    from hybridep import build_hybridep_abi as abi

    lib = abi._declare(_raw(hybridep_lib))
    assert lib.art_hybridep_abi_version() == abi.ABI_VERSION
    good = dict(world_size=2, rank=0, num_tokens=4, num_local_experts=2, pad_multiple=1)
    stale = abi.LayoutParams.make(**good)
    stale.abi_version = 99
    assert lib.art_hybridep_preprocess(ctypes.byref(stale)) == 10001
    bad_rank = abi.LayoutParams.make(**{**good, "rank": 2})  # rank outside the group
    assert lib.art_hybridep_preprocess(ctypes.byref(bad_rank)) == 10002
    no_pointers = abi.PermuteParams.make(
        num_recv_rows=4, num_permuted=4, hidden_dim=8, num_local_experts=2
    )
    assert lib.art_hybridep_permute(ctypes.byref(no_pointers)) == 10002
    barrier = abi.BarrierParams.make(world_size=2, timeout_ns=0)
    assert lib.art_hybridep_barrier(ctypes.byref(barrier)) == 10002
    pointers = dict(arrivals=8, epoch=8, status=8, timeout_ns=1, world_size=2)
    not_a_flag = abi.BarrierParams.make(**pointers, abort_flag=2)
    assert lib.art_hybridep_barrier(ctypes.byref(not_a_flag)) == 10002
    negative_sms = abi.LayoutParams.make(**good, num_sms=-1)
    assert lib.art_hybridep_preprocess(ctypes.byref(negative_sms)) == 10002


def test_hybridep_kernels_do_not_spill_and_combine_fits_two_blocks_per_sm(hybridep_lib):
    """Combine is held to 64 registers (launch bounds: two 512-thread blocks per SM) and no
    HybridEP kernel spills to local memory, so the occupancy the launch asks for is real."""
    import re

    usage = _cuobjdump_output("--dump-resource-usage", hybridep_lib.path)
    kernels = re.findall(
        r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", usage
    )
    combine = [(name, int(reg)) for name, reg, _, _ in kernels if "combine_kernel" in name]
    assert len(combine) == 3, usage  # bf16, fp16, fp32
    assert all(reg <= 64 for _, reg in combine), combine
    assert [(n, st, lo) for n, _, st, lo in kernels if st != "0" or lo != "0"] == []


def test_hybridep_library_is_refused_for_another_arch(hybridep_lib):
    with pytest.raises(kb.KernelArchMismatch, match="current GPU is sm_100a"):
        kb.load(hybridep_lib, current_arch="sm_100a")


# -- where the CUTLASS headers come from, and what the cache records (issue 12, item 2) ------
def _meta(built) -> dict:
    import json

    return json.loads((built.path.parent / "meta.json").read_text())


def test_grouped_gemm_key_holds_the_cutlass_version_and_meta_the_headers_read(grouped_gemm_lib):
    from art_megatron_ext.ops import cutlass_grouped_gemm as cg

    cutlass = cg.find_cutlass()
    assert cutlass.version.count(".") == 2 and cutlass.version != "unknown"
    meta = _meta(grouped_gemm_lib)
    assert meta["version_tags"] == [f"cutlass={cutlass.version}"]
    by_dir = {}
    for index, rel, _ in meta["headers"]:
        by_dir.setdefault(index, set()).add(rel)
    assert (
        "cute/tensor.hpp" in by_dir[2] and "cutlass/gemm/group_array_problem_shape.hpp" in by_dir[2]
    )
    assert "cutlass/util/packed_stride.hpp" in by_dir[3]
    assert len(by_dir[2]) > 100  # what nvcc actually read, not the whole 27 MB tree


def test_carried_cutlass_tree_is_found_through_the_env_override_and_hits_the_cache(
    grouped_gemm_lib, kernel_config, tmp_path, monkeypatch
):
    """What the GPU check does: the headers travel to another path without nvidia-cutlass."""
    from art_megatron_ext.ops import cutlass_grouped_gemm as cg

    installed = cg.find_cutlass().root
    carried = tmp_path / "cutlass"
    shutil.copytree(installed / "include", carried / "include")
    shutil.copytree(installed / "tools" / "util" / "include", carried / "tools/util/include")
    monkeypatch.setenv(cg.CUTLASS_DIR_ENV, str(carried))
    found = cg.find_cutlass()
    assert found.root == carried.resolve() and found.origin == "$ART_CUTLASS_DIR"
    spec = cg.library_spec()
    assert spec.include_dirs[2] == carried.resolve() / "include"
    no_nvcc = kb.BuildConfig(cache_dir=kernel_config.cache_dir, nvcc="nvcc-does-not-exist")
    hit = kb.find_cached(spec, no_nvcc)
    assert hit is not None and hit.path == grouped_gemm_lib.path


def test_incomplete_cutlass_override_is_refused_not_skipped(tmp_path, monkeypatch):
    from art_megatron_ext.ops import cutlass_grouped_gemm as cg

    (tmp_path / "include" / "cutlass").mkdir(parents=True)
    monkeypatch.setenv(cg.CUTLASS_DIR_ENV, str(tmp_path))
    with pytest.raises(cg.CutlassHeadersMissing, match=r"ART_CUTLASS_DIR.*missing.*version\.h"):
        cg.library_spec()
    assert "packed_stride.hpp" in cg.cutlass_unavailable_reason()


def test_no_cutlass_anywhere_names_both_ways_to_get_it(monkeypatch):
    import importlib.util

    from art_megatron_ext.ops import cutlass_grouped_gemm as cg

    monkeypatch.delenv(cg.CUTLASS_DIR_ENV, raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        cg.importlib.util, "find_spec", lambda n, *a: None if n == "cutlass_library" else real(n)
    )
    reason = cg.cutlass_unavailable_reason()
    assert "ART_CUTLASS_DIR is unset" in reason and "nvidia-cutlass" in reason


def test_cached_kernel_libraries_load_without_nvcc(hybridep_lib, kernel_config):
    from hybridep import build_hybridep_abi as abi

    no_nvcc = kb.BuildConfig(cache_dir=kernel_config.cache_dir, nvcc="nvcc-does-not-exist")
    hit = kb.build(abi.library_spec(), no_nvcc)
    assert hit.path == hybridep_lib.path
    lib = abi._declare(_raw(hit))
    assert lib.art_hybridep_abi_version() == abi.ABI_VERSION
