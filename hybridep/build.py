"""Build cache for our CUDA kernels: compile `csrc/` with nvcc once, load with ctypes.

Why not `torch.utils.cpp_extension`: the CPU torch of CI refuses `.cu` sources, and our kernels
sit behind a small C ABI anyway, so a plain `nvcc -shared` library loaded with `ctypes` works
with every torch build (a CPU torch included, where a launch returns a CUDA error instead of
crashing). See docs/kernels.md.

The cache key is computed without running anything (so a cached library loads on a machine
without nvcc): sha256 over the library name, every source and local header byte, the flags,
the target arch and the spec's version tags (e.g. the CUTLASS version read from its headers).
An entry `<cache_dir>/<name>-<key16>/` holds `lib<name>.so` and `meta.json`, which records
what the key cannot know beforehand: the sha256 and size of the library, its exported symbols,
the nvcc that built it (its CUDA release, major.minor, and its full build string), and the
sha256 of every external header the compiler actually read (nvcc `-MD`). A cache hit is used
only if all of these still hold: the library's digest (a truncated or replaced file would
crash `dlopen` with SIGBUS), the spec's symbols, the headers (an edited or upgraded CUTLASS
tree), the arch, and, when nvcc is on PATH, its release (another build string of the same
release is the same compiler for our purpose: cudart is linked statically and the machine
code is fixed by the arch). Anything else is a corrupt or stale entry: it is rebuilt with a
message naming the reason.

Several ranks may build at once: they serialise on a file lock beside the entry, the first
builds into a per-process temporary directory and renames the library into place atomically,
the rest find it done. A library built for another arch than the current GPU is refused.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CACHE_DIR_ENV = "ART_PIPELINE_KERNEL_CACHE"
"""Documented override of the default cache directory (a typed `BuildConfig` wins over it)."""

PACKAGE_CSRC = Path(__file__).resolve().parent / "_csrc"
"""Where the CUDA sources sit in an installed wheel (package data, copied by setup.py)."""
CHECKOUT_CSRC = Path(__file__).resolve().parent.parent / "csrc"
"""Where they sit in a source checkout (and an editable install)."""
SM90A = "sm_90a"
META_VERSION = 2
_HEADER_SUFFIXES = (".h", ".cuh", ".hpp")


class KernelBuildError(RuntimeError):
    """nvcc failed (the message carries the compiler's output), nvcc or the sources are
    missing, or a library lacks a symbol of its C ABI."""


class KernelArchMismatch(RuntimeError):
    """A cached library was built for another GPU arch than the one present."""


def _first_csrc() -> Path:
    for candidate in (PACKAGE_CSRC, CHECKOUT_CSRC):
        if (candidate / "common" / "art_abi.h").is_file():
            return candidate
    return CHECKOUT_CSRC


CSRC_DIR = _first_csrc()
"""The CUDA sources: the installed package's copy first, else the checkout's `csrc/`."""


def find_csrc() -> Path:
    """`CSRC_DIR`, or a `KernelBuildError` naming both places looked at when it is absent."""
    if not (CSRC_DIR / "common" / "art_abi.h").is_file():
        raise KernelBuildError(
            f"CUDA sources not found: looked for {PACKAGE_CSRC} (installed package) and "
            f"{CHECKOUT_CSRC} (source checkout); reinstall art-pipeline"
        )
    return CSRC_DIR


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
    """Print progress (compile start/end, waiting on another builder's lock) to stderr.
    A corrupt or stale cache entry is reported whatever this says."""
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
    version_tags: tuple[str, ...] = ()
    """Versions of external inputs known without compiling (e.g. "cutlass=4.2.0"): in the key."""


@dataclass(frozen=True)
class BuiltLibrary:
    spec: KernelLibrarySpec
    path: Path
    key: str
    arch: str


class _StaleEntry(Exception):
    """A cache entry that must not be loaded; the message says why."""


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


def _nvcc_exe(nvcc: str) -> str | None:
    return shutil.which(nvcc)


@dataclass(frozen=True)
class NvccVersion:
    """What `nvcc --version` says: the release decides cache validity, the build is recorded."""

    release: str
    """major.minor, e.g. "13.0": what a cached library must match (see `_verify_entry`)."""
    build: str
    """The last line, e.g. "Build cuda_13.0.r13.0/compiler.36424714_0" (for the record only)."""


_RELEASE_PATTERNS = (
    re.compile(r"\brelease (\d+)\.(\d+)\b"),  # "Cuda compilation tools, release 13.0, V13.0.88"
    re.compile(r"\bV(\d+)\.(\d+)\.\d+"),  # the same line's full version
    re.compile(r"\bcuda_(\d+)\.(\d+)\b"),  # "Build cuda_13.0.r13.0/...": all a META 2 entry has
)


def parse_nvcc_release(text: str) -> str | None:
    """major.minor of the CUDA release in `nvcc --version` output (or in its last line alone,
    which is what entries written before `nvcc_release` existed record); None if absent."""
    for pattern in _RELEASE_PATTERNS:
        found = pattern.search(text)
        if found:
            return f"{int(found.group(1))}.{int(found.group(2))}"
    return None


def parse_nvcc_version(text: str, exe: str = "nvcc") -> NvccVersion:
    """`NvccVersion` of `nvcc --version` output; a `KernelBuildError` quoting it if no release
    can be read from it (nothing is built or reused on a guess)."""
    lines = text.strip().splitlines()
    release = parse_nvcc_release(text)
    if release is None or not lines:
        raise KernelBuildError(
            f'cannot read the CUDA release ("release X.Y") from `{exe} --version`; it printed: '
            f"{text.strip()!r}"
        )
    return NvccVersion(release=release, build=lines[-1].strip())


@functools.lru_cache(maxsize=8)
def nvcc_version(nvcc: str = "nvcc") -> NvccVersion:
    exe = _nvcc_exe(nvcc)
    if exe is None:
        raise KernelBuildError(
            f"nvcc not found (looked for {nvcc!r} on PATH); install the CUDA toolkit or set "
            "BuildConfig(nvcc=...)"
        )
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True)
    return parse_nvcc_version(out.stdout, exe)


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
    """sha256 of everything known before compiling that changes the binary.

    Runs no program: nvcc's version and the external headers the compiler reads are recorded
    in the entry's meta.json and checked there. Include paths count by content, not location,
    so the same CUTLASS tree found elsewhere (a carried copy) hits the same entry."""
    h = hashlib.sha256()
    for part in (
        spec.name,
        config.arch,
        " ".join(base_flags(config.arch) + spec.extra_flags),
        " ".join(spec.version_tags),
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


def _say(config: BuildConfig, msg: str, always: bool = False) -> None:
    if config.verbose or always:
        print(f"[art-pipeline kernels] {msg}", file=sys.stderr, flush=True)


def _run_nvcc(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise KernelBuildError(
            f"nvcc failed while building {what} (exit {proc.returncode}).\n"
            f"command: {' '.join(cmd)}\n--- compiler output ---\n{proc.stdout}{proc.stderr}"
        )


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def parse_depfile(text: str) -> list[str]:
    """Prerequisites of a make-style dependency file written by `nvcc -MD -MF`."""
    body = text.replace("\\\n", " ")
    deps: list[str] = []
    for line in body.splitlines():
        if ":" not in line:
            continue
        _, _, rest = line.partition(": ")
        token = ""
        for part in rest.split(" "):
            if token:
                token += " " + part
            elif part:
                token = part
            else:
                continue
            if token.endswith("\\"):  # an escaped space inside a path
                token = token[:-1]
                continue
            deps.append(token)
            token = ""
    return deps


def _used_headers(spec: KernelLibrarySpec, dep_files: list[Path]) -> list[list[Any]]:
    """[include-dir index, path inside it, sha256] of every header the compiler read from an
    include dir of the spec (CUDA and system headers are covered by the nvcc version)."""
    roots = [d.resolve() for d in spec.include_dirs]
    found: dict[tuple[int, str], str] = {}
    for dep_file in dep_files:
        for dep in parse_depfile(dep_file.read_text()):
            path = (dep_file.parent / dep).resolve()
            if path.suffix not in _HEADER_SUFFIXES:
                continue
            for index, root in enumerate(roots):
                if path.is_relative_to(root):
                    rel = path.relative_to(root).as_posix()
                    found.setdefault((index, rel), _file_digest(path))
                    break
    return [[index, rel, digest] for (index, rel), digest in sorted(found.items())]


def _compile(spec: KernelLibrarySpec, config: BuildConfig, out: Path, workdir: Path) -> list:
    nvcc = _nvcc_exe(config.nvcc) or config.nvcc
    flags = [*base_flags(config.arch), *spec.extra_flags]
    flags += [f"-I{d}" for d in spec.include_dirs]
    objects = [workdir / f"{i:02d}_{src.stem}.o" for i, src in enumerate(spec.sources)]

    def compile_one(i: int) -> None:
        src, t0 = spec.sources[i], time.monotonic()
        _say(config, f"{spec.name}: compiling {src.name} ({i + 1}/{len(spec.sources)}) ...")
        dep = objects[i].with_suffix(".d")
        cmd = [nvcc, *flags, "-MD", "-MF", str(dep), "-c", str(src), "-o", str(objects[i])]
        _run_nvcc(cmd, f"{spec.name}/{src.name}")
        _say(config, f"{spec.name}: {src.name} done in {time.monotonic() - t0:.1f} s")

    with ThreadPoolExecutor(max_workers=max(1, config.jobs)) as pool:
        list(pool.map(compile_one, range(len(spec.sources))))  # re-raises the first failure
    link = [nvcc, *base_flags(config.arch), "-shared", *map(str, objects), "-o", str(out)]
    _run_nvcc(link, f"{spec.name} (link)")
    return _used_headers(spec, [o.with_suffix(".d") for o in objects])


def exported_symbols(path: Path) -> set[str]:
    """Dynamic symbols defined by a shared library, read with binutils `nm -D`."""
    proc = subprocess.run(
        ["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True
    )
    return {line.split()[-1] for line in proc.stdout.splitlines() if line.strip()}


def _check_symbols(spec: KernelLibrarySpec, path: Path) -> set[str]:
    symbols = exported_symbols(path)
    missing = sorted(set(spec.symbols) - symbols)
    if missing:
        raise KernelBuildError(f"{path} does not export the C ABI symbols {missing}")
    return symbols


def _verify_entry(
    spec: KernelLibrarySpec, config: BuildConfig, entry: Path, lib: Path, key: str
) -> BuiltLibrary:
    """Check a cache entry against its meta.json without loading it; raise `_StaleEntry`."""
    try:
        meta = json.loads((entry / "meta.json").read_text())
    except FileNotFoundError as exc:
        raise _StaleEntry("meta.json is missing") from exc
    except (OSError, ValueError) as exc:
        raise _StaleEntry(f"meta.json is unreadable ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("meta_version") != META_VERSION:
        raise _StaleEntry("meta.json is from another cache format or malformed")
    try:
        recorded_key, arch = meta["key"], meta["arch"]
        size, digest, symbols = meta["size"], meta["sha256"], set(meta["symbols"])
        headers, built_with = meta["headers"], meta["nvcc"]
    except (KeyError, TypeError) as exc:
        raise _StaleEntry(f"meta.json lacks the field {exc}") from exc
    if recorded_key != key or meta.get("name") != spec.name:
        raise _StaleEntry("meta.json belongs to another library or key")
    if not lib.is_file():
        raise _StaleEntry(f"{lib.name} is missing")
    actual_size = lib.stat().st_size
    if actual_size != size:
        raise _StaleEntry(f"{lib.name} is {actual_size} bytes, {size} were built (truncated?)")
    if _file_digest(lib) != digest:
        raise _StaleEntry(f"{lib.name} does not match the sha256 recorded when it was built")
    missing = sorted(set(spec.symbols) - symbols)
    if missing:
        raise _StaleEntry(f"{lib.name} does not export {missing}")
    for index, rel, header_digest in headers:
        if index >= len(spec.include_dirs):
            raise _StaleEntry(f"header {rel} came from an include dir this spec does not have")
        path = Path(spec.include_dirs[index]) / rel
        if not path.is_file():
            raise _StaleEntry(f"header {path} it was built with is gone")
        if _file_digest(path) != header_digest:
            raise _StaleEntry(f"header {path} changed since the library was built")
    if arch != config.arch:
        raise _StaleEntry(f"built for {arch}, {config.arch} is asked for")
    # nvcc's release, not its build string: cudart is linked statically and the machine code
    # is fixed by the arch, so another build of the same release (a carried cache on the GPU
    # host) makes the same library; another release may not. Entries written before
    # `nvcc_release` existed record only the build line, which names the release too.
    built_release = meta.get("nvcc_release") or parse_nvcc_release(str(built_with))
    if not built_release:
        raise _StaleEntry(f"meta.json records nvcc {built_with!r}, whose release is unreadable")
    if _nvcc_exe(config.nvcc) is not None:
        current = nvcc_version(config.nvcc)
        if current.release != built_release:
            raise _StaleEntry(
                f"built by nvcc release {built_release} ({built_with!r}), nvcc on PATH is "
                f"release {current.release} ({current.build!r})"
            )
    return BuiltLibrary(spec=spec, path=lib, key=key, arch=arch)


def find_cached(spec: KernelLibrarySpec, config: BuildConfig | None = None) -> BuiltLibrary | None:
    """The valid cached library for `spec`, or None; never compiles (works without nvcc)."""
    config = config or BuildConfig()
    key = cache_key(spec, config)
    entry = Path(config.cache_dir) / f"{spec.name}-{key[:16]}"
    try:
        return _verify_entry(spec, config, entry, entry / f"lib{spec.name}.so", key)
    except _StaleEntry:
        return None


def build(spec: KernelLibrarySpec, config: BuildConfig | None = None) -> BuiltLibrary:
    """Return the cached library for `spec`, compiling it (once, across processes) if absent,
    corrupt or stale."""
    config = config or BuildConfig()
    key = cache_key(spec, config)
    entry = Path(config.cache_dir) / f"{spec.name}-{key[:16]}"
    lib = entry / f"lib{spec.name}.so"
    if (entry / "meta.json").exists() or lib.exists():
        try:
            return _verify_entry(spec, config, entry, lib, key)
        except _StaleEntry:
            pass  # re-checked under the lock: another process may be rebuilding it
    entry.mkdir(parents=True, exist_ok=True)
    with open(entry.with_suffix(".lock"), "w") as lock:
        _lock(lock, config, spec.name)
        if (entry / "meta.json").exists() or lib.exists():
            try:
                return _verify_entry(spec, config, entry, lib, key)
            except _StaleEntry as why:
                _say(config, f"{spec.name}: cache entry {entry} is unusable: {why}; rebuilding",
                     always=True)  # fmt: skip
                for stale in (lib, entry / "meta.json"):
                    stale.unlink(missing_ok=True)
        _build_entry(spec, config, entry, lib, key)
        return _verify_entry(spec, config, entry, lib, key)


def _build_entry(
    spec: KernelLibrarySpec, config: BuildConfig, entry: Path, lib: Path, key: str
) -> None:
    version = nvcc_version(config.nvcc)  # raises the clear "nvcc not found" first
    t0 = time.monotonic()
    _say(config, f"{spec.name}: building for {config.arch} into {entry}")
    with tempfile.TemporaryDirectory(prefix=f"build-{os.getpid()}-", dir=entry) as tmp:
        tmp_lib = Path(tmp) / lib.name
        headers = _compile(spec, config, tmp_lib, Path(tmp))
        symbols = _check_symbols(spec, tmp_lib)
        meta = {
            "meta_version": META_VERSION,
            "name": spec.name,
            "key": key,
            "arch": config.arch,
            "nvcc": version.build,
            "nvcc_release": version.release,
            "torch": _torch_version(),
            "version_tags": list(spec.version_tags),
            "size": tmp_lib.stat().st_size,
            "sha256": _file_digest(tmp_lib),
            "symbols": sorted(s for s in symbols if not s.startswith("_")),
            "headers": headers,
        }
        tmp_meta = Path(tmp) / "meta.json"
        tmp_meta.write_text(json.dumps(meta, indent=1))
        os.replace(tmp_lib, lib)  # atomic: readers see no library or a whole one
        os.replace(tmp_meta, entry / "meta.json")
    _say(config, f"{spec.name}: built in {time.monotonic() - t0:.1f} s")


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
    """Load a built library with ctypes after refusing an arch mismatch; every symbol of its
    spec must resolve in the loaded object."""
    check_arch(built, current_arch)
    lib = ctypes.CDLL(str(built.path))
    missing = [name for name in built.spec.symbols if not hasattr(lib, name)]
    if missing:
        raise KernelBuildError(f"{built.path} loaded but does not resolve {missing}")
    return lib
