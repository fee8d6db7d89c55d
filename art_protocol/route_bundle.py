"""The binary route bundle: many trajectories' routed experts in one buffer.

Why: rollouts hand the trainer one `[tokens, layers, topk]` expert-id array per trajectory.
The common wire format (JSON with base64 int32 arrays) is 5x larger than it needs to be and
costs a base64 pass plus a JSON parse per byte. The bundle is a fixed header, the token counts
and then the raw little-endian arrays in the narrowest dtype that holds `num_experts`, so
encoding is one copy per array and decoding returns numpy views into the received buffer.

The format (magic, version, every field) is specified in `docs/formats.md`; this module is its
implementation. Decoding never trusts the header: every size is checked against the buffer
length before a view is made, so a hostile or truncated bundle raises `RouteBundleError` and
never allocates memory in proportion to what the header claims.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

BUNDLE_MAGIC = b"ARTR"
BUNDLE_VERSION = 1
# magic, version, dtype code, flags, count, num_experts, num_layers, topk, reserved, total tokens
_HEADER = struct.Struct("<4sHBBIIHHIQ")
HEADER_SIZE = _HEADER.size  # 32
DATA_ALIGNMENT = 8

# dtype codes of version 1; the code must be the narrowest dtype that holds `num_experts`.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype("<u1"),
    2: np.dtype("<u2"),
    3: np.dtype("<i4"),
}
_CODE_OF = {dtype: code for code, dtype in DTYPE_CODES.items()}
MAX_NUM_EXPERTS = 2**31 - 1


class RouteBundleError(ValueError):
    """A route bundle (or the arrays to encode into one) is malformed; the message says how."""


def route_dtype_for(num_experts: int) -> np.dtype:
    """The narrowest dtype that holds expert ids `0..num_experts-1`: uint8, uint16 or int32."""
    if not 1 <= num_experts <= MAX_NUM_EXPERTS:
        raise RouteBundleError(f"num_experts must be in [1, {MAX_NUM_EXPERTS}], got {num_experts}")
    if num_experts <= 2**8:
        return DTYPE_CODES[1]
    if num_experts <= 2**16:
        return DTYPE_CODES[2]
    return DTYPE_CODES[3]


@dataclass(frozen=True)
class RouteBundle:
    """A decoded bundle. `routes[i]` is trajectory i's `[tokens_i, num_layers, topk]` view
    into `flat`, which itself is a view of the received buffer (no copy was made)."""

    num_experts: int
    num_layers: int
    topk: int
    token_counts: np.ndarray  # uint32 [count], a view
    flat: np.ndarray  # [sum(token_counts), num_layers, topk], a view
    routes: list[np.ndarray]

    @property
    def dtype(self) -> np.dtype:
        return self.flat.dtype


def _data_offset(count: int) -> int:
    end_of_counts = HEADER_SIZE + 4 * count
    return -(-end_of_counts // DATA_ALIGNMENT) * DATA_ALIGNMENT


def _check_ids(array: np.ndarray, num_experts: int, what: str) -> None:
    """Reject expert ids outside [0, num_experts) without scanning when the dtype cannot hold
    one (uint8 with 256 experts needs no scan)."""
    if array.size == 0:
        return
    info = np.iinfo(array.dtype)
    if info.min < 0 and int(array.min()) < 0:
        raise RouteBundleError(f"{what}: negative expert id {int(array.min())}")
    if info.max >= num_experts:
        top = int(array.max())
        if top >= num_experts:
            raise RouteBundleError(f"{what}: expert id {top} >= num_experts {num_experts}")


def encode_route_bundle(
    routes: Sequence[np.ndarray],
    *,
    num_experts: int,
    num_layers: int | None = None,
    topk: int | None = None,
) -> bytearray:
    """Encode per-trajectory `[tokens, num_layers, topk]` integer arrays into one bundle.

    Each array is range-checked and then copied (cast to the bundle dtype in the same pass)
    straight into its place in the output buffer: one copy per byte, no intermediate bytes.
    `num_layers`/`topk` are taken from the arrays when not given (required for an empty list).

    Raises:
        RouteBundleError: naming the trajectory index, for a wrong rank/shape, a non-integer
            dtype, or an expert id outside [0, num_experts).
    """
    dtype = route_dtype_for(num_experts)
    if num_layers is None or topk is None:
        if not routes:
            raise RouteBundleError("num_layers and topk are required to encode an empty bundle")
        first = np.asarray(routes[0])
        if first.ndim != 3:
            raise RouteBundleError(
                f"trajectory 0: routes must be [tokens, layers, topk], got shape {first.shape}"
            )
        num_layers = first.shape[1] if num_layers is None else num_layers
        topk = first.shape[2] if topk is None else topk
    if not (1 <= num_layers < 2**16 and 1 <= topk < 2**16):
        raise RouteBundleError(f"num_layers {num_layers} and topk {topk} must be in [1, 65535]")
    if topk > num_experts:
        raise RouteBundleError(f"topk {topk} exceeds num_experts {num_experts}")
    counts = np.empty(len(routes), dtype="<u4")
    for index, array in enumerate(routes):
        if not isinstance(array, np.ndarray) or array.dtype.kind not in "iu":
            raise RouteBundleError(
                f"trajectory {index}: routes must be an integer numpy array, got "
                f"{getattr(array, 'dtype', type(array).__name__)}"
            )
        if array.ndim != 3 or array.shape[1:] != (num_layers, topk):
            raise RouteBundleError(
                f"trajectory {index}: routes shape {array.shape} is not "
                f"[tokens, {num_layers}, {topk}]"
            )
        if array.shape[0] >= 2**32:
            raise RouteBundleError(f"trajectory {index}: {array.shape[0]} tokens exceed 2**32-1")
        counts[index] = array.shape[0]
    total_tokens = int(counts.sum(dtype=np.uint64))
    row = num_layers * topk * dtype.itemsize
    start = _data_offset(len(routes))
    buffer = bytearray(start + total_tokens * row)
    _HEADER.pack_into(
        buffer,
        0,
        BUNDLE_MAGIC,
        BUNDLE_VERSION,
        _CODE_OF[dtype],
        0,
        len(routes),
        num_experts,
        num_layers,
        topk,
        0,
        total_tokens,
    )
    np.frombuffer(buffer, dtype="<u4", count=len(routes), offset=HEADER_SIZE)[:] = counts
    # A 1-D destination: numpy copies a contiguous source as one memmove instead of walking
    # three dimensions (about twice as fast for route-sized arrays).
    flat = np.frombuffer(buffer, dtype=dtype, offset=start)
    per_token = num_layers * topk
    cursor = 0
    for index, array in enumerate(routes):
        _check_ids(array, num_experts, f"trajectory {index}")
        size = array.shape[0] * per_token
        np.copyto(flat[cursor : cursor + size], array.reshape(-1), casting="unsafe")
        cursor += size
    return buffer


def decode_route_bundle(data: bytes | bytearray | memoryview) -> RouteBundle:
    """Decode a bundle into numpy views of `data` (no copy; views of `bytes` are read-only).

    Every header field is checked against the buffer length before any view is made.

    Raises:
        RouteBundleError: for a wrong magic, an unknown version or dtype code, non-zero
            reserved fields, truncated or trailing data, token counts that do not add up to the
            header's total, or an expert id outside [0, num_experts).
    """
    try:
        view = memoryview(data).cast("B")
    except TypeError as exc:
        raise RouteBundleError(
            f"a route bundle must be a contiguous bytes-like object, got {type(data).__name__}"
        ) from exc
    size = view.nbytes
    if size < HEADER_SIZE:
        raise RouteBundleError(f"truncated bundle: {size} bytes, the header alone is {HEADER_SIZE}")
    (magic, version, code, flags, count, num_experts, num_layers, topk, reserved, total) = (
        _HEADER.unpack_from(view, 0)
    )
    if magic != BUNDLE_MAGIC:
        raise RouteBundleError(
            f"not a route bundle: magic {bytes(magic)!r}, expected {BUNDLE_MAGIC!r}"
        )
    if version != BUNDLE_VERSION:
        raise RouteBundleError(
            f"unsupported route bundle version {version}; this reader knows {BUNDLE_VERSION}"
        )
    if code not in DTYPE_CODES:
        raise RouteBundleError(f"unknown dtype code {code}; known codes are {sorted(DTYPE_CODES)}")
    if flags != 0 or reserved != 0:
        raise RouteBundleError(
            f"reserved header fields must be 0 (flags={flags}, reserved={reserved})"
        )
    if not 1 <= num_experts <= MAX_NUM_EXPERTS:
        raise RouteBundleError(f"num_experts {num_experts} outside [1, {MAX_NUM_EXPERTS}]")
    dtype = DTYPE_CODES[code]
    if dtype != route_dtype_for(num_experts):
        raise RouteBundleError(
            f"dtype code {code} ({dtype}) is not the narrowest dtype for {num_experts} experts "
            f"({route_dtype_for(num_experts)})"
        )
    if num_layers == 0 or topk == 0 or topk > num_experts:
        raise RouteBundleError(
            f"bad shape fields: num_layers={num_layers}, topk={topk}, num_experts={num_experts}"
        )
    start = _data_offset(count)
    row = num_layers * topk * dtype.itemsize
    expected = start + total * row  # Python ints: no overflow, nothing allocated yet
    if size != expected:
        raise RouteBundleError(
            f"bundle length {size} does not match its header ({count} trajectories, {total} "
            f"tokens x {num_layers} layers x top-{topk} x {dtype.itemsize} B => {expected} bytes)"
        )
    counts = np.frombuffer(view, dtype="<u4", count=count, offset=HEADER_SIZE)
    counted = int(counts.sum(dtype=np.uint64))
    if counted != total:
        raise RouteBundleError(
            f"token counts add up to {counted}, header says {total} (negative or corrupt counts)"
        )
    if any(view[HEADER_SIZE + 4 * count : start]):
        raise RouteBundleError("alignment padding after the token counts must be zero")
    flat = np.frombuffer(view, dtype=dtype, offset=start).reshape(total, num_layers, topk)
    _check_ids(flat, num_experts, "bundle")
    ends = np.cumsum(counts, dtype=np.int64)
    routes = [flat[int(end) - int(n) : int(end)] for n, end in zip(counts, ends, strict=True)]
    return RouteBundle(
        num_experts=num_experts,
        num_layers=num_layers,
        topk=topk,
        token_counts=counts,
        flat=flat,
        routes=routes,
    )
