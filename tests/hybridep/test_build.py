"""The kernel build cache: keyed, locked, arch-checked, loud on failure (hybridep.build).

Uses a tiny `.cu` written into a temporary directory so each compile takes ~2 s; the real
kernels are compiled in test_build_kernels.py.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
from pathlib import Path

import pytest

from hybridep import build as kb

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc on PATH")

TINY_CU = r"""
#include "art_abi.h"
__global__ void add_one(int* x) { x[threadIdx.x] += 1; }
ART_API int tiny_add_one(int* x, int n) {
  add_one<<<1, n>>>(x);
  return (int)cudaGetLastError();
}
int tiny_hidden_helper() { return 7; }
"""


def _spec(src_dir: Path, body: str = TINY_CU, symbols=("tiny_add_one",)) -> kb.KernelLibrarySpec:
    src = src_dir / "tiny.cu"
    src.write_text(body)
    return kb.KernelLibrarySpec(
        name="tiny",
        sources=(src,),
        symbols=tuple(symbols),
        include_dirs=(kb.CSRC_DIR / "common",),
        headers=(kb.CSRC_DIR / "common" / "art_abi.h",),
    )


@pytest.fixture
def src_dir(tmp_path):
    d = tmp_path / "src"
    d.mkdir()
    return d


@pytest.fixture
def config(tmp_path):
    return kb.BuildConfig(cache_dir=tmp_path / "cache", verbose=True)


def test_build_exports_only_the_c_abi_and_is_cached(src_dir, config, capsys):
    spec = _spec(src_dir)
    built = kb.build(spec, config)
    assert built.path.exists() and built.arch == "sm_90a"
    symbols = kb.exported_symbols(built.path)
    assert "tiny_add_one" in symbols
    assert not any("tiny_hidden_helper" in s for s in symbols), "non-ABI symbol leaked"
    assert "building for sm_90a" in capsys.readouterr().err
    mtime = built.path.stat().st_mtime_ns
    again = kb.build(spec, config)
    assert again.path == built.path and again.path.stat().st_mtime_ns == mtime
    assert "building" not in capsys.readouterr().err


def test_key_changes_with_source_flags_and_arch(src_dir, config):
    spec = _spec(src_dir)
    key = kb.cache_key(spec, config)
    assert kb.cache_key(spec, kb.BuildConfig(cache_dir=config.cache_dir, arch="sm_100a")) != key
    flagged = kb.KernelLibrarySpec(**{**spec.__dict__, "extra_flags": ("-DFOO=1",)})
    assert kb.cache_key(flagged, config) != key
    (src_dir / "tiny.cu").write_text(TINY_CU + "\n// edited\n")
    assert kb.cache_key(spec, config) != key


def test_header_next_to_source_is_part_of_the_key(src_dir, config):
    spec = _spec(src_dir)
    key = kb.cache_key(spec, config)
    (src_dir / "local.cuh").write_text("#pragma once\n")
    assert kb.cache_key(spec, config) != key


def test_failed_build_shows_the_compiler_error(src_dir, config):
    spec = _spec(src_dir, body=TINY_CU + "\nint broken( { return this_is_not_declared; }\n")
    with pytest.raises(kb.KernelBuildError, match=r"(?s)nvcc failed.*compiler output.*error"):
        kb.build(spec, config)
    assert not kb.library_path(spec, config).exists()


def test_missing_abi_symbol_is_a_build_error(src_dir, config):
    spec = _spec(src_dir, symbols=("tiny_add_one", "tiny_not_there"))
    with pytest.raises(kb.KernelBuildError, match="tiny_not_there"):
        kb.build(spec, config)


def test_library_for_another_arch_is_refused(src_dir, config):
    built = kb.build(_spec(src_dir), config)
    with pytest.raises(kb.KernelArchMismatch, match=r"built for sm_90a.*current GPU is sm_100a"):
        kb.load(built, current_arch="sm_100a")
    with pytest.raises(kb.KernelArchMismatch, match="no CUDA GPU is present"):
        kb.load(built, current_arch=None)


def test_matching_arch_loads_with_ctypes(src_dir, config):
    built = kb.build(_spec(src_dir), config)
    lib = kb.load(built, current_arch="sm_90a")
    assert hasattr(lib, "tiny_add_one")


def test_cache_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv(kb.CACHE_DIR_ENV, str(tmp_path / "elsewhere"))
    assert kb.BuildConfig().cache_dir == tmp_path / "elsewhere"
    monkeypatch.delenv(kb.CACHE_DIR_ENV)
    assert kb.BuildConfig().cache_dir == Path.home() / ".cache" / "art-pipeline" / "kernels"


def test_missing_nvcc_names_the_executable(src_dir, tmp_path):
    config = kb.BuildConfig(cache_dir=tmp_path / "c", nvcc="nvcc-does-not-exist")
    with pytest.raises(kb.KernelBuildError, match="nvcc-does-not-exist"):
        kb.build(_spec(src_dir), config)


def _build_in_child(src_dir: str, cache_dir: str, queue, start) -> None:
    import time as _time

    start.wait(timeout=120)  # all builders race for the same entry at once
    t0 = _time.monotonic()
    built = kb.build(_spec(Path(src_dir)), kb.BuildConfig(cache_dir=Path(cache_dir)))
    queue.put((str(built.path), built.path.stat().st_ino, t0))


def test_concurrent_builders_build_once(src_dir, tmp_path, capfd):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    start = ctx.Barrier(3)
    cache = tmp_path / "shared-cache"
    procs = [
        ctx.Process(target=_build_in_child, args=(str(src_dir), str(cache), queue, start))
        for _ in range(3)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    results = [queue.get(timeout=5) for _ in procs]
    assert len({path for path, _, _ in results}) == 1
    assert len({inode for _, inode, _ in results}) == 1, "library was replaced after first build"
    err = capfd.readouterr().err
    assert err.count("building for sm_90a") == 1, err
    assert "waiting for its lock" in err, "builders did not contend for the lock"
    entry = Path(results[0][0]).parent
    assert not [p for p in entry.iterdir() if p.name.startswith("build-")], "temp dir left"
