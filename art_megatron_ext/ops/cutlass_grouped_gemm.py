"""ctypes binding of `libart_grouped_gemm.so` (csrc/grouped_gemm), built through hybridep.build.

Why ctypes and not a torch extension: the library is a plain `nvcc -shared` build with a C ABI
(see docs/kernels.md), so the same binary works under any torch build; tensors cross the ABI
as raw device pointers plus the current CUDA stream.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridep import build as kbuild

ABI_VERSION = 2
CONFIG_AUTO = -1
CONFIG_NAMES = {0: "cooperative_256x128x64", 1: "pingpong_128x128x64"}
SYMBOLS = (
    "art_grouped_gemm_abi_version",
    "art_grouped_gemm_workspace_size",
    "art_grouped_gemm_pick_config",
    "art_grouped_gemm_fwd",
    "art_grouped_gemm_dgrad",
    "art_grouped_gemm_wgrad",
)
_STATUS = {
    10001: "ABI mismatch (params version/size differ from the library)",
    10002: "bad argument (shape, alignment or null pointer)",
    10003: "unsupported request",
    10004: "CUTLASS refused the problem (can_implement/initialize/run)",
}


class CutlassGroupedGemmError(RuntimeError):
    """A call into the CUTLASS grouped GEMM library returned an error status."""


class GroupedGemmCountsError(ValueError):
    """Device-side `tokens_per_expert` did not describe the rows of x (found on the GPU)."""


class GroupedGemmParams(ctypes.Structure):
    """Mirror of `ArtGroupedGemmParams` in csrc/grouped_gemm/grouped_gemm.h (same field order)."""

    _fields_ = [
        ("abi_version", ctypes.c_uint32),
        ("struct_size", ctypes.c_uint32),
        ("num_groups", ctypes.c_int32),
        ("config", ctypes.c_int32),
        ("total_rows", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("group_end", ctypes.c_void_p),
        ("a", ctypes.c_void_p),
        ("b", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("workspace", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_int64),
        ("stream", ctypes.c_void_p),
        ("device", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("error_flag", ctypes.c_void_p),
    ]


CUTLASS_DIR_ENV = "ART_CUTLASS_DIR"
"""Override of where the CUTLASS headers are: a directory holding `include/cutlass/` and
`tools/util/include/cutlass/util/` (a CUTLASS checkout, or the tree `make gpu-carry` copies
for a machine without `nvidia-cutlass`). When set it is used or refused, never skipped."""


class CutlassHeadersMissing(RuntimeError):
    """No usable CUTLASS header tree; the message names every place looked at."""


@dataclass(frozen=True)
class CutlassHeaders:
    root: Path
    version: str
    """CUTLASS_MAJOR.MINOR.PATCH read from `include/cutlass/version.h` (part of the key)."""
    origin: str
    """Where the tree came from: `$ART_CUTLASS_DIR` or the `nvidia-cutlass` package."""

    @property
    def include_dirs(self) -> tuple[Path, Path]:
        return (self.root / "include", self.root / "tools" / "util" / "include")


def _read_cutlass_version(root: Path) -> str:
    text = (root / "include" / "cutlass" / "version.h").read_text()
    parts = [re.search(rf"#define CUTLASS_{p}\s+(\d+)", text) for p in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise CutlassHeadersMissing(f"{root}/include/cutlass/version.h has no CUTLASS version")
    return ".".join(m.group(1) for m in parts if m)


def _check_cutlass_root(root: Path, origin: str) -> CutlassHeaders:
    needed = (
        root / "include" / "cutlass" / "version.h",
        root / "include" / "cute" / "tensor.hpp",
        root / "tools" / "util" / "include" / "cutlass" / "util" / "packed_stride.hpp",
    )
    absent = [str(p) for p in needed if not p.is_file()]
    if absent:
        raise CutlassHeadersMissing(
            f"CUTLASS headers from {origin} at {root} are incomplete: missing {absent}"
        )
    return CutlassHeaders(root=root, version=_read_cutlass_version(root), origin=origin)


def find_cutlass() -> CutlassHeaders:
    """`$ART_CUTLASS_DIR` if set (refused if incomplete), else the `nvidia-cutlass` package's
    `cutlass_library/source`; found without importing anything."""
    override = os.environ.get(CUTLASS_DIR_ENV)
    if override:
        return _check_cutlass_root(Path(override).expanduser().resolve(), f"${CUTLASS_DIR_ENV}")
    found = importlib.util.find_spec("cutlass_library")
    if found is None or found.origin is None:
        raise CutlassHeadersMissing(
            f"CUTLASS headers not found: ${CUTLASS_DIR_ENV} is unset and the nvidia-cutlass "
            "package is not installed (pip install 'art-pipeline[megatron]', or point "
            f"${CUTLASS_DIR_ENV} at a CUTLASS checkout)"
        )
    return _check_cutlass_root(Path(found.origin).parent / "source", "the nvidia-cutlass package")


def cutlass_unavailable_reason() -> str | None:
    """Why the CUTLASS library cannot be built here (None when the headers are there)."""
    try:
        find_cutlass()
    except CutlassHeadersMissing as exc:
        return str(exc)
    return None


def library_unavailable_reason(config: kbuild.BuildConfig | None = None) -> str | None:
    """Why `load_library(config)` can neither load nor build the library here, or None.

    Why this order: the headers come first because the cache key holds the CUTLASS version
    (no headers, no key, no cache hit); a valid cached build comes before nvcc because it
    loads without a compiler (the build cache's promise); only then is nvcc needed. A probe
    of the file system (sources hashed, the cached `.so` digested, PATH searched): callers
    cache the answer (`grouped_gemm` resolves its backend once per process) instead of
    calling it per GEMM. The GPU itself is not checked here.
    """
    try:
        spec = library_spec()
    except (CutlassHeadersMissing, kbuild.KernelBuildError) as exc:
        return str(exc)
    config = config or kbuild.BuildConfig()
    if kbuild.find_cached(spec, config) is not None:
        return None
    if shutil.which(config.nvcc) is None:
        return (
            f"no valid cached build of {spec.name} in {config.cache_dir} and nvcc "
            f"({config.nvcc!r}) is not on PATH to build one; put the CUDA toolkit's nvcc on "
            f"PATH, or set ${kbuild.CACHE_DIR_ENV} to a kernel cache holding a build of this "
            "source tree and CUTLASS version"
        )
    return None


def library_spec() -> kbuild.KernelLibrarySpec:
    """The build recipe: four translation units, CUTLASS headers from `find_cutlass()`."""
    cutlass = find_cutlass()
    csrc = kbuild.find_csrc()
    src = csrc / "grouped_gemm"
    return kbuild.KernelLibrarySpec(
        name="art_grouped_gemm",
        sources=tuple(src / f for f in ("gg_api.cu", "gg_fwd.cu", "gg_dgrad.cu", "gg_wgrad.cu")),
        symbols=SYMBOLS,
        include_dirs=(csrc / "common", src, *cutlass.include_dirs),
        headers=(csrc / "common" / "art_abi.h",),
        # the key holds the CUTLASS version; meta.json the digest of every header nvcc read
        version_tags=(f"cutlass={cutlass.version}",),
    )


@functools.lru_cache(maxsize=4)
def load_library(config: kbuild.BuildConfig | None = None) -> ctypes.CDLL:
    """Build (once, cached on disk) and load the library for the current GPU."""
    built = kbuild.build(library_spec(), config)
    lib = kbuild.load(built, kbuild.device_arch())
    for name in SYMBOLS[1:]:
        getattr(lib, name).argtypes = [ctypes.POINTER(GroupedGemmParams)] + (
            [ctypes.POINTER(ctypes.c_int64)] if name.endswith("workspace_size") else []
        )
        getattr(lib, name).restype = ctypes.c_int
    lib.art_grouped_gemm_pick_config.argtypes = [
        ctypes.POINTER(GroupedGemmParams),
        ctypes.POINTER(ctypes.c_int32),
    ]
    lib.art_grouped_gemm_abi_version.restype = ctypes.c_uint32
    if lib.art_grouped_gemm_abi_version() != ABI_VERSION:
        raise CutlassGroupedGemmError(
            f"{built.path} has ABI version {lib.art_grouped_gemm_abi_version()}, expected "
            f"{ABI_VERSION}; delete the cache entry {built.path.parent}"
        )
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        reason = _STATUS.get(status) or f"CUDA error {status}"
        raise CutlassGroupedGemmError(f"CUTLASS grouped GEMM {what} failed: {reason}")


_ERROR_FLAGS: dict[int, torch.Tensor] = {}


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _error_flag(device: torch.device) -> torch.Tensor:
    """int32 [1] in pinned host memory for `device`: the kernels' setup step stores 1 there
    when the device-side group ends are inconsistent (pinned memory is mapped into the GPU's
    address space, so the host reads it without a synchronization)."""
    index = _device_index(device)
    if index not in _ERROR_FLAGS:
        _ERROR_FLAGS[index] = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    return _ERROR_FLAGS[index]


def check_device_errors() -> None:
    """Raise `GroupedGemmCountsError` if a finished call met a device-side `tokens_per_expert`
    that does not sum to its rows (or was negative). No synchronization: call it after one
    you already have (every call of this module does it on entry). The bad groups were
    computed as empty, so nothing outside the tensors was touched; the outputs of that call
    are wrong. Clears the flag."""
    for index, flag in _ERROR_FLAGS.items():
        if int(flag[0]) != 0:
            flag.zero_()
            raise GroupedGemmCountsError(
                f"a CUTLASS grouped GEMM on cuda:{index} got tokens_per_expert (on the GPU) that "
                "is negative or does not sum to x.shape[0]; its output is wrong (the groups "
                "past the mismatch were left empty). Fix the counts the router produced."
            )


def _stream_of(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _params(a, b, out, group_end, k, n, total_rows, config) -> GroupedGemmParams:
    return GroupedGemmParams(
        abi_version=ABI_VERSION,
        struct_size=ctypes.sizeof(GroupedGemmParams),
        num_groups=group_end.numel(),
        config=config,
        total_rows=total_rows,
        k=k,
        n=n,
        group_end=group_end.data_ptr(),
        a=a.data_ptr(),
        b=b.data_ptr(),
        out=out.data_ptr(),
        stream=_stream_of(a.device),
        device=_device_index(a.device),
        error_flag=_error_flag(a.device).data_ptr(),
    )


def _call(op: str, params: GroupedGemmParams, device, lib) -> None:
    """Run one op. Zero rows need no workspace: the library returns (fwd/dgrad) or only
    zeroes dW (wgrad) without reading the row matrices, whose data pointers are then null."""
    check_device_errors()
    workspace = None
    if params.total_rows > 0:
        size = ctypes.c_int64(0)
        _check(lib.art_grouped_gemm_workspace_size(ctypes.byref(params), ctypes.byref(size)), op)
        workspace = torch.empty(size.value, dtype=torch.uint8, device=device)
        params.workspace = workspace.data_ptr()
        params.workspace_bytes = size.value
    _check(getattr(lib, f"art_grouped_gemm_{op}")(ctypes.byref(params)), op)


def fwd(x, w, group_end, config: int = CONFIG_AUTO, lib=None) -> torch.Tensor:
    """Y[T,n] with Y_g = X_g @ W_g; x [T,k] and w [G,k,n] contiguous bf16 on an sm_90 GPU."""
    lib = lib or load_library()
    y = torch.empty(x.shape[0], w.shape[2], dtype=x.dtype, device=x.device)
    p = _params(x, w, y, group_end, w.shape[1], w.shape[2], x.shape[0], config)
    _call("fwd", p, x.device, lib)
    return y


def dgrad(dy, w, group_end, config: int = CONFIG_AUTO, lib=None) -> torch.Tensor:
    """dX[T,k] with dX_g = dY_g @ W_g^T."""
    lib = lib or load_library()
    dx = torch.empty(dy.shape[0], w.shape[1], dtype=dy.dtype, device=dy.device)
    p = _params(dy, w, dx, group_end, w.shape[1], w.shape[2], dy.shape[0], config)
    _call("dgrad", p, dy.device, lib)
    return dx


def wgrad(x, dy, group_end, config: int = CONFIG_AUTO, lib=None) -> torch.Tensor:
    """dW[G,k,n] with dW_g = X_g^T @ dY_g (zero for an empty group)."""
    lib = lib or load_library()
    groups = group_end.numel()
    dw = torch.empty(groups, x.shape[1], dy.shape[1], dtype=x.dtype, device=x.device)
    p = _params(x, dy, dw, group_end, x.shape[1], dy.shape[1], x.shape[0], config)
    _call("wgrad", p, x.device, lib)
    return dw


def picked_config(total_rows: int, groups: int, k: int, n: int, lib=None) -> str:
    """Name of the tile config AUTO chooses for a forward of this shape."""
    lib = lib or load_library()
    p = GroupedGemmParams(
        abi_version=ABI_VERSION,
        struct_size=ctypes.sizeof(GroupedGemmParams),
        num_groups=groups,
        config=CONFIG_AUTO,
        total_rows=total_rows,
        k=k,
        n=n,
    )
    chosen = ctypes.c_int32(-1)
    _check(lib.art_grouped_gemm_pick_config(ctypes.byref(p), ctypes.byref(chosen)), "pick")
    return CONFIG_NAMES[chosen.value]
