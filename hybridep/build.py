"""Build cache for our CUDA kernels: compile `csrc/` with nvcc once, load with ctypes.

Why not `torch.utils.cpp_extension`: the CPU torch of CI refuses `.cu` sources, and our kernels
sit behind a small C ABI anyway, so a plain `nvcc -shared` library loaded with `ctypes` works
with every torch build (a CPU torch included, where a launch returns a CUDA error instead of
crashing). See docs/kernels.md.

Cache key = sha256 over (library name, every source and header byte, nvcc version, torch
version, flags, target arch). An entry is a directory `<cache_dir>/<name>-<key16>/` holding
`lib<name>.so` and `meta.json`. Several ranks may build at once: they serialise on a file lock
beside the entry, the first builds into a per-process temporary file and renames it into place
atomically, the rest find it done. A library built for another arch than the current GPU is
refused, never loaded.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

CACHE_DIR_ENV = "ART_PIPELINE_KERNEL_CACHE"
"""Documented override of the default cache directory (a typed `BuildConfig` wins over it)."""

REPO_ROOT = Path(__file__).resolve().parent.parent
CSRC_DIR = REPO_ROOT / "csrc"
SM90A = "sm_90a"
_HEADER_SUFFIXES = (".h", ".cuh", ".hpp")


class KernelBuildError(RuntimeError):
    """nvcc failed (the message carries the compiler's output) or nvcc is missing."""


class KernelArchMismatch(RuntimeError):
    """A cached library was built for another GPU arch than the one present."""


def default_cache_dir() -> Path:
    """`$ART_PIPELINE_KERNEL_CACHE` if set, else `~/.cache/art-pipeline/kernels`."""
    override = os.environ.get(CACHE_DIR_ENV)
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "art-pipeline" / "kernels"


@dataclass(frozen=True)
class BuildConfig:
    """Where and how kernels are built. Tests point `cache_dir` at a temporary directory."""

    cache_dir: Path = field(default_factory=default_cache_dir)
    nvcc: str = "nvcc"
    arch: str = SM90A
    """Target arch, e.g. "sm_90a"; compiled as `-gencode arch=compute_90a,code=sm_90a`."""
    verbose: bool = True
    """Print progress (compile start/end, waiting on another builder's lock) to stderr."""
    lock_timeout_s: float = 1800.0
    jobs: int = 1
    """Translation units compiled at once (1 on a small shared box; more on a GPU host)."""


@dataclass(frozen=True)
class KernelLibrarySpec:
    """One shared library: its sources, include dirs, extra flags and its C ABI symbols."""

    name: str
    sources: tuple[Path, ...]
    symbols: tuple[str, ...]
    """Every `extern "C"` symbol the Python side calls; checked after build and at load."""
    include_dirs: tuple[Path, ...] = ()
    extra_flags: tuple[str, ...] = ()
    headers: tuple[Path, ...] = ()
    """Extra headers hashed into the key; headers next to the sources are hashed anyway."""


@dataclass(frozen=True)
class BuiltLibrary:
    spec: KernelLibrarySpec
    path: Path
    key: str
    arch: str


def base_flags(arch: str) -> tuple[str, ...]:
    """Flags every kernel library gets. `-DNDEBUG` also keeps wgmma from being serialized."""
    return (
        f"-gencode=arch={arch.replace('sm_', 'compute_')},code={arch}",
        "-O3",
        "-DNDEBUG",
        "-std=c++17",
        "--expt-relaxed-constexpr",
        "-Xcompiler=-fPIC",
        "-Xcompiler=-fvisibility=hidden",
        "-cudart=static",
    )


@functools.lru_cache(maxsize=8)
def nvcc_version(nvcc: str = "nvcc") -> str:
    exe = shutil.which(nvcc)
    if exe is None:
        raise KernelBuildError(
            f"nvcc not found (looked for {nvcc!r} on PATH); install the CUDA toolkit or set "
            "BuildConfig(nvcc=...)"
        )
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def _torch_version() -> str:
    try:
        import torch
    except ImportError:
        return "no-torch"
    return torch.__version__


def _hashed_files(spec: KernelLibrarySpec) -> list[Path]:
    files = {p.resolve() for p in spec.sources} | {p.resolve() for p in spec.headers}
    for src in spec.sources:
        for p in src.resolve().parent.iterdir():
            if p.suffix in _HEADER_SUFFIXES:
                files.add(p)
    return sorted(files)


def cache_key(spec: KernelLibrarySpec, config: BuildConfig) -> str:
    """sha256 of everything that changes the binary; external include trees count by path."""
    h = hashlib.sha256()
    for part in (
        spec.name,
        nvcc_version(config.nvcc),
        _torch_version(),
        config.arch,
        " ".join(base_flags(config.arch) + spec.extra_flags),
        " ".join(str(p) for p in spec.include_dirs),
    ):
        h.update(part.encode())
        h.update(b"\0")
    for path in _hashed_files(spec):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def entry_dir(spec: KernelLibrarySpec, config: BuildConfig) -> Path:
    return Path(config.cache_dir) / f"{spec.name}-{cache_key(spec, config)[:16]}"


def library_path(spec: KernelLibrarySpec, config: BuildConfig) -> Path:
    return entry_dir(spec, config) / f"lib{spec.name}.so"


def _say(config: BuildConfig, msg: str) -> None:
    if config.verbose:
        print(f"[art-pipeline kernels] {msg}", file=sys.stderr, flush=True)


def _run_nvcc(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise KernelBuildError(
            f"nvcc failed while building {what} (exit {proc.returncode}).\n"
            f"command: {' '.join(cmd)}\n--- compiler output ---\n{proc.stdout}{proc.stderr}"
        )


def _compile(spec: KernelLibrarySpec, config: BuildConfig, out: Path, workdir: Path) -> None:
    nvcc = shutil.which(config.nvcc) or config.nvcc
    flags = [*base_flags(config.arch), *spec.extra_flags]
    flags += [f"-I{d}" for d in spec.include_dirs]
    objects = [str(workdir / f"{i:02d}_{src.stem}.o") for i, src in enumerate(spec.sources)]

    def compile_one(i: int) -> None:
        src, t0 = spec.sources[i], time.monotonic()
        _say(config, f"{spec.name}: compiling {src.name} ({i + 1}/{len(spec.sources)}) ...")
        _run_nvcc([nvcc, *flags, "-c", str(src), "-o", objects[i]], f"{spec.name}/{src.name}")
        _say(config, f"{spec.name}: {src.name} done in {time.monotonic() - t0:.1f} s")

    with ThreadPoolExecutor(max_workers=max(1, config.jobs)) as pool:
        list(pool.map(compile_one, range(len(spec.sources))))  # re-raises the first failure
    link = [nvcc, *base_flags(config.arch), "-shared", *objects, "-o", str(out)]
    _run_nvcc(link, f"{spec.name} (link)")


def exported_symbols(path: Path) -> set[str]:
    """Dynamic symbols defined by a shared library, read with binutils `nm -D`."""
    proc = subprocess.run(
        ["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True
    )
    return {line.split()[-1] for line in proc.stdout.splitlines() if line.strip()}


def _check_symbols(spec: KernelLibrarySpec, path: Path) -> None:
    missing = sorted(set(spec.symbols) - exported_symbols(path))
    if missing:
        raise KernelBuildError(f"{path} does not export the C ABI symbols {missing}")


def build(spec: KernelLibrarySpec, config: BuildConfig | None = None) -> BuiltLibrary:
    """Return the cached library for `spec`, compiling it (once, across processes) if absent."""
    config = config or BuildConfig()
    key = cache_key(spec, config)
    entry = Path(config.cache_dir) / f"{spec.name}-{key[:16]}"
    lib = entry / f"lib{spec.name}.so"
    if lib.exists():
        return _checked_entry(spec, entry, lib, key)
    entry.mkdir(parents=True, exist_ok=True)
    with open(entry.with_suffix(".lock"), "w") as lock:
        _lock(lock, config, spec.name)
        if not lib.exists():  # another builder may have finished while we waited
            t0 = time.monotonic()
            _say(config, f"{spec.name}: building for {config.arch} into {entry}")
            with tempfile.TemporaryDirectory(prefix=f"build-{os.getpid()}-", dir=entry) as tmp:
                tmp_lib = Path(tmp) / lib.name
                _compile(spec, config, tmp_lib, Path(tmp))
                _check_symbols(spec, tmp_lib)
                meta = {
                    "name": spec.name,
                    "key": key,
                    "arch": config.arch,
                    "nvcc": nvcc_version(config.nvcc),
                    "torch": _torch_version(),
                }
                (entry / "meta.json").write_text(json.dumps(meta, indent=1))
                os.replace(tmp_lib, lib)  # atomic: readers see no library or a whole one
            _say(config, f"{spec.name}: built in {time.monotonic() - t0:.1f} s")
    return _checked_entry(spec, entry, lib, key)


def _lock(lock_file, config: BuildConfig, name: str) -> None:
    try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        _say(config, f"{name}: another process is building it; waiting for its lock ...")
    deadline = time.monotonic() + config.lock_timeout_s
    while time.monotonic() < deadline:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(0.2)
    raise KernelBuildError(
        f"timed out after {config.lock_timeout_s:.0f} s waiting for the build lock "
        f"{lock_file.name}; is another build of {name} hung?"
    )


def _checked_entry(spec: KernelLibrarySpec, entry: Path, lib: Path, key: str) -> BuiltLibrary:
    meta = json.loads((entry / "meta.json").read_text())
    return BuiltLibrary(spec=spec, path=lib, key=key, arch=meta["arch"])


def device_arch(device_index: int | None = None) -> str | None:
    """The arch name we compile for on the current GPU ("sm_90a" on Hopper); None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device_index)
    suffix = "a" if major >= 9 else ""
    return f"sm_{major}{minor}{suffix}"


def check_arch(built: BuiltLibrary, current: str | None) -> None:
    """Refuse a library built for another arch than `current` (the present GPU's)."""
    if current is None:
        raise KernelArchMismatch(
            f"{built.spec.name} was built for {built.arch}, but no CUDA GPU is present; "
            "these kernels need a GPU of that arch"
        )
    if built.arch != current:
        raise KernelArchMismatch(
            f"cached {built.spec.name} at {built.path} was built for {built.arch}, but the "
            f"current GPU is {current}; build with BuildConfig(arch={current!r}) (our kernels "
            f"support {SM90A} only)"
        )


def load(built: BuiltLibrary, current_arch: str | None) -> ctypes.CDLL:
    """Load a built library with ctypes after refusing an arch mismatch."""
    check_arch(built, current_arch)
    return ctypes.CDLL(str(built.path))
