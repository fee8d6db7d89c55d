"""The kernel build cache: keyed, locked, arch-checked, loud on failure (hybridep.build).

Uses a tiny `.cu` written into a temporary directory so each compile takes ~2 s; the real
kernels are compiled in test_build_kernels.py.
"""

from __future__ import annotations

import json
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


def _spec(
    src_dir: Path, body: str | None = TINY_CU, symbols=("tiny_add_one",)
) -> kb.KernelLibrarySpec:
    src = src_dir / "tiny.cu"
    if body is not None:  # None: the file is already there (concurrent builders read it)
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


@pytest.fixture(scope="module")
def template_cache(tmp_path_factory):
    """One real build of the tiny library per module; tests that start from a built entry
    copy it instead of compiling again (the key depends on file names and bytes only)."""
    root = tmp_path_factory.mktemp("tiny-template")
    (root / "src").mkdir()
    cache = root / "cache"
    kb.build(_spec(root / "src"), kb.BuildConfig(cache_dir=cache, verbose=False))
    return cache


@pytest.fixture
def prebuilt(src_dir, config, template_cache):
    """(spec, built library) with the entry copied from the module's template build."""
    shutil.copytree(template_cache, config.cache_dir)
    spec = _spec(src_dir)
    built = kb.find_cached(spec, config)
    assert built is not None, "template entry was not a valid hit"
    return spec, built


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


def test_library_for_another_arch_is_refused(prebuilt):
    _, built = prebuilt
    with pytest.raises(kb.KernelArchMismatch, match=r"built for sm_90a.*current GPU is sm_100a"):
        kb.load(built, current_arch="sm_100a")
    with pytest.raises(kb.KernelArchMismatch, match="no CUDA GPU is present"):
        kb.load(built, current_arch=None)


def test_matching_arch_loads_with_ctypes(prebuilt):
    _, built = prebuilt
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
    built = kb.build(_spec(Path(src_dir), body=None), kb.BuildConfig(cache_dir=Path(cache_dir)))
    queue.put((str(built.path), built.path.stat().st_ino, t0))


def test_concurrent_builders_build_once(src_dir, tmp_path, capfd):
    _spec(src_dir)  # written once, before the builders start
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


# -- cache validity: corrupt, stale, and nvcc-less entries (issue 12, item 2) ---------------
def _entry_files(built: kb.BuiltLibrary) -> tuple[Path, Path]:
    return built.path, built.path.parent / "meta.json"


def _rebuilt(spec, config, capfd, reason: str) -> kb.BuiltLibrary:
    again = kb.build(spec, config)
    err = capfd.readouterr().err
    assert "is unusable" in err and reason in err, err
    assert "building for sm_90a" in err, err
    return again


@pytest.mark.parametrize(
    "damage,reason",
    [
        ("bad_meta", "meta.json is unreadable"),
        ("no_meta", "meta.json is missing"),
        ("no_lib", "is missing"),
        ("truncated", "(truncated?)"),
        ("same_size_other_bytes", "does not match the sha256"),
    ],
)
def test_corrupt_entry_is_detected_and_rebuilt_with_a_message(
    prebuilt, config, capfd, damage, reason
):
    spec, built = prebuilt
    lib, meta = _entry_files(built)
    capfd.readouterr()
    data = lib.read_bytes()
    if damage == "bad_meta":
        meta.write_text("{not json")
    elif damage == "no_meta":
        meta.unlink()
    elif damage == "no_lib":
        lib.unlink()
    elif damage == "truncated":  # what made dlopen SIGBUS before: never loaded now
        lib.write_bytes(data[: len(data) // 3])
    else:
        lib.write_bytes(data[:-64] + bytes(64))
    assert kb.find_cached(spec, config) is None
    again = _rebuilt(spec, config, capfd, reason)
    assert again.path.read_bytes() != b"" and kb.find_cached(spec, config) is not None
    assert hasattr(kb.load(again, "sm_90a"), "tiny_add_one")  # loads: a whole library again


def test_spec_symbol_missing_from_cached_library_rebuilds_and_fails_loudly(
    src_dir, config, capfd, prebuilt
):
    capfd.readouterr()
    # same sources (same key), but the Python side now expects a symbol the library lacks
    with pytest.raises(kb.KernelBuildError, match="tiny_new_entry_point"):
        kb.build(_spec(src_dir, symbols=("tiny_add_one", "tiny_new_entry_point")), config)
    assert "does not export ['tiny_new_entry_point']" in capfd.readouterr().err


def test_load_resolves_every_symbol_of_the_spec(prebuilt):
    _, built = prebuilt
    wider = kb.KernelLibrarySpec(**{**built.spec.__dict__, "symbols": ("tiny_add_one", "nope")})
    lying = kb.BuiltLibrary(spec=wider, path=built.path, key=built.key, arch=built.arch)
    with pytest.raises(kb.KernelBuildError, match=r"does not resolve \['nope'\]"):
        kb.load(lying, current_arch="sm_90a")


def _external_spec(src_dir: Path, include: Path) -> kb.KernelLibrarySpec:
    """A library that includes one header of an external tree (like CUTLASS) and not another."""
    body = '#include "ext/used.h"\n' + TINY_CU.replace("x[threadIdx.x] += 1", "x[0] += EXT_ONE")
    spec = _spec(src_dir, body=body)
    return kb.KernelLibrarySpec(
        **{**spec.__dict__, "include_dirs": (*spec.include_dirs, include),
           "version_tags": ("ext=1.0.0",)}
    )  # fmt: skip


def _external_tree(root: Path) -> Path:
    (root / "ext").mkdir(parents=True)
    (root / "ext" / "used.h").write_text("#pragma once\n#define EXT_ONE 1\n")
    (root / "ext" / "unused.h").write_text("#pragma once\n")
    return root


def test_external_headers_actually_used_decide_validity(src_dir, config, tmp_path, capfd):
    include = _external_tree(tmp_path / "ext-tree")
    spec = _external_spec(src_dir, include)
    built = kb.build(spec, config)
    meta = json.loads((built.path.parent / "meta.json").read_text())
    used = [rel for index, rel, _ in meta["headers"] if index == len(spec.include_dirs) - 1]
    assert used == ["ext/used.h"], meta["headers"]  # read by nvcc; unused.h was not
    capfd.readouterr()
    (include / "ext" / "unused.h").write_text("#pragma once\n// edited\n")
    assert kb.build(spec, config).path.stat().st_ino == built.path.stat().st_ino  # still a hit
    assert "building" not in capfd.readouterr().err
    (include / "ext" / "used.h").write_text("#pragma once\n#define EXT_ONE 2\n")
    _rebuilt(spec, config, capfd, "used.h changed since the library was built")


def test_version_tag_is_part_of_the_key(src_dir, config, tmp_path):
    spec = _external_spec(src_dir, _external_tree(tmp_path / "t"))
    bumped = kb.KernelLibrarySpec(**{**spec.__dict__, "version_tags": ("ext=1.1.0",)})
    assert kb.cache_key(spec, config) != kb.cache_key(bumped, config)


def test_same_header_tree_at_another_path_hits_the_same_entry(src_dir, config, tmp_path, capfd):
    """A carried copy of the external headers (another path, same bytes) reuses the entry."""
    original = _external_tree(tmp_path / "installed")
    built = kb.build(_external_spec(src_dir, original), config)
    carried = tmp_path / "carried"
    shutil.copytree(original, carried)
    capfd.readouterr()
    again = kb.build(_external_spec(src_dir, carried), config)
    assert again.path == built.path and "building" not in capfd.readouterr().err


def test_cached_library_loads_without_nvcc(prebuilt, config, monkeypatch):
    spec, built = prebuilt
    no_nvcc = kb.BuildConfig(cache_dir=config.cache_dir, nvcc="nvcc-does-not-exist")

    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"ran a program to find a cached library: {args}")

    kb.nvcc_version.cache_clear()
    monkeypatch.setattr(kb.subprocess, "run", no_subprocess)
    assert kb.cache_key(spec, no_nvcc) == built.key
    assert kb.build(spec, no_nvcc).path == built.path
    assert kb.find_cached(spec, no_nvcc) is not None
    assert hasattr(kb.load(kb.build(spec, no_nvcc), "sm_90a"), "tiny_add_one")


def test_without_nvcc_a_missing_entry_says_nvcc_is_missing(src_dir, tmp_path):
    config = kb.BuildConfig(cache_dir=tmp_path / "empty", nvcc="nvcc-does-not-exist")
    assert kb.find_cached(_spec(src_dir), config) is None
    with pytest.raises(kb.KernelBuildError, match="nvcc not found"):
        kb.build(_spec(src_dir), config)


def _nvcc_output(release: str, build_id: str = "36424714") -> str:
    """What `nvcc --version` prints (CUDA 13.0's layout), for another release or build."""
    return (
        "nvcc: NVIDIA (R) Cuda compiler driver\n"
        "Copyright (c) 2005-2025 NVIDIA Corporation\n"
        "Built on Wed_Aug_20_01:58:59_PM_PDT_2025\n"
        f"Cuda compilation tools, release {release}, V{release}.88\n"
        f"Build cuda_{release}.r{release}/compiler.{build_id}_0\n"
    )


def _fake_nvcc(monkeypatch, text: str) -> None:
    """The nvcc on PATH (still the real compiler) reports `text` as its version."""
    monkeypatch.setattr(kb, "nvcc_version", lambda nvcc="nvcc": kb.parse_nvcc_version(text))


def _recorded_release(built: kb.BuiltLibrary) -> str:
    return json.loads((built.path.parent / "meta.json").read_text())["nvcc_release"]


def test_meta_records_the_nvcc_release_and_build_string(prebuilt):
    _, built = prebuilt
    meta = json.loads((built.path.parent / "meta.json").read_text())
    real = kb.nvcc_version()
    assert meta["nvcc_release"] == real.release and meta["nvcc"] == real.build
    assert meta["nvcc"].startswith("Build cuda_") and f"cuda_{real.release}" in meta["nvcc"]


def test_same_nvcc_release_with_another_build_string_reuses_the_entry(
    prebuilt, config, capfd, monkeypatch
):
    """A carried pre-built library on a host whose nvcc is another build of the same release
    is loaded, not rebuilt (1-2 minutes of device time on the GPU check)."""
    spec, built = prebuilt
    release = _recorded_release(built)
    _fake_nvcc(monkeypatch, _nvcc_output(release, build_id="99999999"))
    capfd.readouterr()
    assert kb.find_cached(spec, config) is not None
    again = kb.build(spec, config)
    assert again.path.stat().st_ino == built.path.stat().st_ino
    assert "building" not in capfd.readouterr().err


def test_another_nvcc_release_rebuilds_naming_both_releases(prebuilt, config, capfd, monkeypatch):
    spec, built = prebuilt
    release = _recorded_release(built)
    _fake_nvcc(monkeypatch, _nvcc_output("99.9"))
    assert kb.find_cached(spec, config) is None
    capfd.readouterr()
    again = _rebuilt(spec, config, capfd, f"built by nvcc release {release} (")
    meta = json.loads((again.path.parent / "meta.json").read_text())
    assert meta["nvcc_release"] == "99.9"
    _fake_nvcc(monkeypatch, _nvcc_output(release))  # and back: stale again, same message form
    assert kb.find_cached(spec, config) is None
    _rebuilt(spec, config, capfd, f"nvcc on PATH is release {release} (")


def test_minor_release_counts(prebuilt, config, monkeypatch):
    """13.1 is not 13.0: another minor release is stale (the whole major.minor is compared)."""
    spec, built = prebuilt
    major, minor = _recorded_release(built).split(".")
    _fake_nvcc(monkeypatch, _nvcc_output(f"{major}.{int(minor) + 1}"))
    assert kb.find_cached(spec, config) is None


def test_entry_without_nvcc_release_reads_it_from_the_build_string(prebuilt, config, capfd):
    """Entries written before `nvcc_release` existed record only the build line; it names the
    release, so they stay valid (no META_VERSION bump, a carried cache is not thrown away)."""
    spec, built = prebuilt
    meta_path = built.path.parent / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["nvcc_release"]
    meta_path.write_text(json.dumps(meta))
    capfd.readouterr()
    assert kb.build(spec, config).path.stat().st_ino == built.path.stat().st_ino
    assert "building" not in capfd.readouterr().err
    meta["nvcc"] = "Build something/unrecognisable"
    meta_path.write_text(json.dumps(meta))
    _rebuilt(spec, config, capfd, "whose release is unreadable")


@pytest.mark.parametrize(
    "text,release",
    [
        (_nvcc_output("13.0"), "13.0"),
        (_nvcc_output("12.4", build_id="34097967"), "12.4"),
        ("Cuda compilation tools, release 12.10, V12.10.1\n", "12.10"),
        ("Build cuda_13.0.r13.0/compiler.36424714_0", "13.0"),  # the build line alone
    ],
)
def test_nvcc_release_is_parsed_from_the_version_output(text, release):
    assert kb.parse_nvcc_version(text).release == release
    assert kb.parse_nvcc_version(text).build == text.strip().splitlines()[-1]


def test_unparseable_nvcc_version_is_a_clear_error(prebuilt, config, monkeypatch):
    spec, _ = prebuilt
    with pytest.raises(kb.KernelBuildError, match=r"cannot read the CUDA release.*'nvcc 0'"):
        kb.parse_nvcc_version("nvcc 0")
    _fake_nvcc(monkeypatch, "some wrapper script, version unknown")
    with pytest.raises(kb.KernelBuildError, match="cannot read the CUDA release"):
        kb.build(spec, config)


def test_depfile_parser_handles_continuations_and_escaped_spaces():
    text = "a.o : a.cu \\\n    /x/y.h \\\n    /with\\ space/z.hpp /q.cuh\n"
    assert kb.parse_depfile(text) == ["a.cu", "/x/y.h", "/with space/z.hpp", "/q.cuh"]


def test_sources_come_from_the_installed_package_when_it_has_them(tmp_path, monkeypatch):
    """An installed wheel carries `hybridep/_csrc`; it wins over a checkout's `csrc/`."""
    packaged = tmp_path / "_csrc"
    shutil.copytree(kb.CHECKOUT_CSRC, packaged)
    monkeypatch.setattr(kb, "PACKAGE_CSRC", packaged)
    assert kb._first_csrc() == packaged
    monkeypatch.setattr(kb, "PACKAGE_CSRC", tmp_path / "absent")
    monkeypatch.setattr(kb, "CHECKOUT_CSRC", tmp_path / "also-absent")
    monkeypatch.setattr(kb, "CSRC_DIR", kb._first_csrc())
    with pytest.raises(kb.KernelBuildError, match=r"CUDA sources not found.*absent"):
        kb.find_csrc()
