"""Build recipe and ctypes mirror of the C ABI of `libart_hybridep.so` (csrc/hybridep/).

Why a separate module: hybridep/backends/cuda.py holds the backend logic; the struct layouts
here must change together with csrc/hybridep/hybridep.h and nothing else.
"""

from __future__ import annotations

import ctypes
import functools

from hybridep import build as kbuild

ABI_VERSION = 3
DTYPE_CODES = {"bfloat16": 0, "float16": 1, "float32": 2}
SYMBOLS = (
    "art_hybridep_abi_version",
    "art_hybridep_preprocess",
    "art_hybridep_permute",
    "art_hybridep_unpermute",
    "art_hybridep_dispatch",
    "art_hybridep_combine",
    "art_hybridep_barrier",
    "art_hybridep_barrier_arrival",
    "art_hybridep_alloc",
    "art_hybridep_free",
    "art_hybridep_ipc_handle",
    "art_hybridep_ipc_open",
    "art_hybridep_ipc_close",
    "art_hybridep_memcpy_d2d",
    "art_hybridep_vector_width",
)
STATUS_WORDS = 4
"""int32 words of a buffer's status block (ART_HEP_STATUS_WORDS in hybridep.h)."""
STATUS_BARRIER_TIMEOUT = 1
"""Word 0 after a barrier timed out; word 1 holds the first missing rank, word 2 the epoch."""
STATUS_PEER_FAILED = 2
"""Word 0 after a rank's call failed between barriers; word 1 holds that rank, word 2 the
epoch of the barrier it aborted at."""
_P = ctypes.c_void_p
_I32, _I64, _U32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_uint32


class _Versioned(ctypes.Structure):
    @classmethod
    def make(cls, **fields):
        return cls(abi_version=ABI_VERSION, struct_size=ctypes.sizeof(cls), **fields)


class LayoutParams(_Versioned):
    _fields_ = [
        ("abi_version", _U32), ("struct_size", _U32), ("device", _I32), ("world_size", _I32),
        ("rank", _I32), ("num_tokens", _I32), ("num_local_experts", _I32),
        ("pad_multiple", _I32), ("num_sms", _I32), ("reserved", _I32), ("budget", _I64),
        ("global_map", _P), ("need", _P), ("sparse_to_dense", _P), ("positions", _P),
        ("tokens_per_expert", _P), ("overflow_flag", _P), ("scratch", _P), ("stream", _P),
    ]  # fmt: skip


class PermuteParams(_Versioned):
    _fields_ = [
        ("abi_version", _U32), ("struct_size", _U32), ("device", _I32), ("dtype", _I32),
        ("num_recv_rows", _I64), ("num_permuted", _I64), ("hidden_dim", _I64),
        ("num_local_experts", _I32), ("max_blocks", _I32), ("with_probs", _I32),
        ("reserved", _I32), ("positions", _P),
        ("recv_hidden", _P), ("recv_probs", _P), ("tokens", _P), ("probs", _P),
        ("source", _P), ("stream", _P),
    ]  # fmt: skip


class IntraParams(_Versioned):
    _fields_ = [
        ("abi_version", _U32), ("struct_size", _U32), ("device", _I32), ("dtype", _I32),
        ("world_size", _I32), ("rank", _I32), ("num_tokens", _I32),
        ("num_local_experts", _I32), ("hidden_dim", _I64), ("static_budget", _I32),
        ("num_sms", _I32), ("with_probs", _I32), ("reserved", _I32), ("sparse_to_dense", _P),
        ("peer_tokens", _P), ("peer_probs", _P), ("hidden", _P), ("probs", _P), ("status", _P),
        ("stream", _P),
    ]  # fmt: skip


class BarrierParams(_Versioned):
    _fields_ = [
        ("abi_version", _U32), ("struct_size", _U32), ("device", _I32), ("world_size", _I32),
        ("rank", _I32), ("abort_flag", _I32), ("arrivals", _P), ("epoch", _P),
        ("timeout_ns", _I64), ("status", _P), ("stream", _P),
    ]  # fmt: skip


def library_spec() -> kbuild.KernelLibrarySpec:
    csrc = kbuild.find_csrc()
    src = csrc / "hybridep"
    return kbuild.KernelLibrarySpec(
        name="art_hybridep",
        sources=tuple(src / f for f in ("preprocess.cu", "permute.cu", "intranode.cu")),
        symbols=SYMBOLS,
        include_dirs=(csrc / "common", src),
        headers=(csrc / "common" / "art_abi.h",),
    )


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.art_hybridep_abi_version.restype = _U32
    for name, struct in (
        ("preprocess", LayoutParams), ("permute", PermuteParams), ("unpermute", PermuteParams),
        ("dispatch", IntraParams), ("combine", IntraParams), ("barrier", BarrierParams),
    ):  # fmt: skip
        fn = getattr(lib, f"art_hybridep_{name}")
        fn.argtypes, fn.restype = [ctypes.POINTER(struct)], ctypes.c_int
    lib.art_hybridep_barrier_arrival.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
    lib.art_hybridep_barrier_arrival.restype = ctypes.c_int
    lib.art_hybridep_alloc.argtypes = [_I32, _I64, ctypes.POINTER(_P)]
    lib.art_hybridep_free.argtypes = [_I32, _P]
    lib.art_hybridep_ipc_handle.argtypes = [_I32, _P, ctypes.c_char_p]
    lib.art_hybridep_ipc_open.argtypes = [_I32, ctypes.c_char_p, ctypes.POINTER(_P)]
    lib.art_hybridep_ipc_close.argtypes = [_I32, _P]
    lib.art_hybridep_memcpy_d2d.argtypes = [_I32, _P, _P, _I64, _P]
    lib.art_hybridep_vector_width.argtypes = [_I32, _I64, _P, _P]
    lib.art_hybridep_vector_width.restype = _I32
    return lib


@functools.lru_cache(maxsize=4)
def load_library(config: kbuild.BuildConfig | None = None) -> ctypes.CDLL:
    """Build (once, cached on disk) and load the HybridEP kernels for the current GPU."""
    built = kbuild.build(library_spec(), config)
    lib = _declare(kbuild.load(built, kbuild.device_arch()))
    if lib.art_hybridep_abi_version() != ABI_VERSION:
        raise RuntimeError(
            f"{built.path} has ABI version {lib.art_hybridep_abi_version()}, expected "
            f"{ABI_VERSION}; delete the cache entry {built.path.parent}"
        )
    return lib
