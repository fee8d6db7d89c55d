"""Collate per-trajectory route arrays into the training batch tensor, writing each byte once.

Why: the batch tensor `[batch, seq, layers, topk]` is large (a 32k x 48-layer x top-8 row is
12 MiB in uint8), and collation sits on the trainer's critical path. The usual code fills the
whole buffer with dummy routes and then overwrites it trajectory by trajectory, so every byte
that holds a route is written twice. Here the output is allocated once (`torch.empty`, or an
earlier call's buffer passed as `out=`), each trajectory's region is copied once, and only the
rows no route covers (padding, and tokens whose routes were not captured) are filled with the
dummy route. The copies are single-threaded: on the 2-core dev box a second thread did not
speed up even the bare copy (`bench/route_collation.py`, "floor 2 threads").

The dummy route is experts `0..topk-1`: `topk` distinct ids, so a dropless MoE layer still
sees exactly `tokens * topk` assignments and no duplicate (token, expert) pair. The returned
`padding_mask` is True on exactly those rows, which is what Megatron's router takes as
`padding_mask` to keep them out of aux-loss and expert-bias accounting.

Placements say where a trajectory's tokens go (row, start, length, first source token), so the
same writer serves a left/right padded batch and prefix-tree packed rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

# Accepted input dtypes, narrowest first; a mixed batch is promoted to the widest present.
# uint16 (what a route bundle uses for 257..65536 experts) is promoted to int32 because torch
# has no general uint16 and int16 cannot hold ids >= 32768.
_RANK = {
    np.dtype(np.uint8): 0,
    np.dtype(np.int16): 1,
    np.dtype(np.uint16): 2,
    np.dtype(np.int32): 2,
}
_OUTPUT = {0: np.dtype(np.uint8), 1: np.dtype(np.int16), 2: np.dtype(np.int32)}
_TORCH_DTYPE = {
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
}


_DUMMY_BLOCK_BYTES = 1 << 20  # stays in L2 while it is copied from


class RouteValidationError(ValueError):
    """Routes that cannot be collated; the message names the trajectory index."""


@dataclass(frozen=True)
class RoutePlacement:
    """Trajectory `trajectory`'s tokens `[source_start, source_start + length)` occupy
    positions `[start, start + length)` of batch row `row`."""

    trajectory: int
    row: int
    start: int
    length: int
    source_start: int = 0


@dataclass(frozen=True)
class CollatedRoutes:
    """`routes` is `[batch, seq, layers, topk]`; `padding_mask[b, s]` is True where no recorded
    route was written (padding or uncaptured tokens) and the dummy route `0..topk-1` sits."""

    routes: torch.Tensor
    padding_mask: torch.Tensor


def _as_numpy(array: np.ndarray | torch.Tensor, index: int) -> np.ndarray:
    if isinstance(array, torch.Tensor):
        if array.device.type != "cpu":
            raise RouteValidationError(
                f"trajectory {index}: routes must be on CPU, got {array.device}"
            )
        return array.detach().numpy()
    if isinstance(array, np.ndarray):
        return array
    raise RouteValidationError(
        f"trajectory {index}: routes must be a numpy array or torch tensor, "
        f"got {type(array).__name__}"
    )


def _validate(
    routes: Sequence[np.ndarray | torch.Tensor | None],
    token_counts: Sequence[int],
    num_layers: int,
    topk: int,
) -> tuple[list[np.ndarray | None], np.dtype]:
    """Check every trajectory's routes (shape, dtype, length) from metadata only, and pick the
    output dtype from the dtypes alone: promotion never needs a scan of the values."""
    if len(routes) != len(token_counts):
        raise RouteValidationError(
            f"{len(routes)} route arrays for {len(token_counts)} trajectories (token counts)"
        )
    arrays: list[np.ndarray | None] = []
    rank = 0
    for index, (array, count) in enumerate(zip(routes, token_counts, strict=True)):
        if array is None:
            arrays.append(None)
            continue
        array = _as_numpy(array, index)
        if array.dtype not in _RANK:
            raise RouteValidationError(
                f"trajectory {index}: routes dtype {array.dtype} is not one of uint8, int16, "
                "uint16, int32"
            )
        if array.ndim != 3 or array.shape[1:] != (num_layers, topk):
            raise RouteValidationError(
                f"trajectory {index}: routes shape {tuple(array.shape)} is not "
                f"[tokens, {num_layers}, {topk}]"
            )
        if array.shape[0] > count:
            raise RouteValidationError(
                f"trajectory {index}: routes cover {array.shape[0]} tokens but the trajectory "
                f"has {count}"
            )
        rank = max(rank, _RANK[array.dtype])
        arrays.append(array)
    return arrays, _OUTPUT[rank]


def _row_segments(
    placements: Sequence[RoutePlacement], token_counts: Sequence[int], batch: int, seq_len: int
) -> list[list[RoutePlacement]]:
    rows: list[list[RoutePlacement]] = [[] for _ in range(batch)]
    for p in placements:
        if not 0 <= p.trajectory < len(token_counts):
            raise RouteValidationError(f"placement {p} names an unknown trajectory")
        if not 0 <= p.row < batch:
            raise RouteValidationError(
                f"trajectory {p.trajectory}: row {p.row} outside [0, {batch})"
            )
        if p.length < 0 or p.start < 0 or p.start + p.length > seq_len:
            raise RouteValidationError(
                f"trajectory {p.trajectory}: positions [{p.start}, {p.start + p.length}) outside "
                f"the row of {seq_len}"
            )
        if p.source_start < 0 or p.source_start + p.length > token_counts[p.trajectory]:
            raise RouteValidationError(
                f"trajectory {p.trajectory}: tokens [{p.source_start}, "
                f"{p.source_start + p.length}) outside its {token_counts[p.trajectory]} tokens"
            )
        rows[p.row].append(p)
    for row in rows:
        row.sort(key=lambda p: p.start)
        for before, after in itertools.pairwise(row):
            if after.start < before.start + before.length:
                raise RouteValidationError(
                    f"trajectories {before.trajectory} and {after.trajectory} overlap in row "
                    f"{after.row} at position {after.start}"
                )
    return rows


def collate_routes(
    routes: Sequence[np.ndarray | torch.Tensor | None],
    token_counts: Sequence[int],
    placements: Sequence[RoutePlacement],
    *,
    batch: int,
    seq_len: int,
    num_layers: int,
    topk: int,
    out: CollatedRoutes | None = None,
) -> CollatedRoutes:
    """Write every placement's routes into one `[batch, seq_len, layers, topk]` tensor and the
    dummy route everywhere else; each output byte is written exactly once.

    Args:
        routes: per trajectory, `[n_i, layers, topk]` with `n_i <= token_counts[i]` (uint8,
            int16, uint16 or int32; a mixed batch is promoted), or None if none were captured.
            Tokens past `n_i` (an uncaptured suffix) get the dummy route and padding_mask True.
        token_counts: each trajectory's token count, to validate `n_i` and placements against.
        placements: where each trajectory's tokens go; placements in a row must not overlap.
        out: buffers from an earlier call to write into instead of allocating (their first
            `batch` rows are used and returned as views). On this CPU, first-touch page faults
            of a fresh 0.5 GB tensor cost about 5x the copy itself (`bench/route_collation.py`),
            so a trainer that keeps the buffer across steps pays only the copy.
    """
    arrays, dtype = _validate(routes, token_counts, num_layers, topk)
    rows = _row_segments(placements, token_counts, batch, seq_len)
    out_routes, mask = _output_buffers(out, dtype, batch, seq_len, num_layers, topk)
    out_np, mask_np = out_routes.numpy(), mask.numpy()
    # A contiguous block of dummy rows, copied from as plain memory: a broadcasting copy from
    # `arange(topk)` runs several times slower than memcpy for the same bytes.
    block_rows = max(1, min(seq_len, _DUMMY_BLOCK_BYTES // (num_layers * topk * dtype.itemsize)))
    dummy_block = np.empty((block_rows, num_layers, topk), dtype=dtype)
    dummy_block[:] = np.arange(topk, dtype=dtype)

    def fill_dummy(row: int, start: int, end: int) -> None:
        if end > start:
            mask_np[row, start:end] = True
            while start < end:
                step = min(end - start, block_rows)
                np.copyto(out_np[row, start : start + step], dummy_block[:step])
                start += step

    for row_index, row in enumerate(rows):
        cursor = 0
        for p in row:
            fill_dummy(row_index, cursor, p.start)
            array = arrays[p.trajectory]
            available = (
                0 if array is None else max(0, min(p.length, array.shape[0] - p.source_start))
            )
            if available:
                np.copyto(
                    out_np[row_index, p.start : p.start + available],
                    array[p.source_start : p.source_start + available],
                    casting="safe",
                )
                mask_np[row_index, p.start : p.start + available] = False
            fill_dummy(row_index, p.start + available, p.start + p.length)
            cursor = p.start + p.length
        fill_dummy(row_index, cursor, seq_len)
    return CollatedRoutes(routes=out_routes, padding_mask=mask)


def _output_buffers(
    out: CollatedRoutes | None,
    dtype: np.dtype,
    batch: int,
    seq_len: int,
    num_layers: int,
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    if out is None:
        routes = torch.empty((batch, seq_len, num_layers, topk), dtype=_TORCH_DTYPE[dtype])
        return routes, torch.empty((batch, seq_len), dtype=torch.bool)
    routes, mask = out.routes, out.padding_mask
    fits = (
        routes.dtype == _TORCH_DTYPE[dtype]
        and routes.shape[0] >= batch
        and tuple(routes.shape[1:]) == (seq_len, num_layers, topk)
        and routes.is_contiguous()
        and routes.device.type == "cpu"
        and mask.dtype == torch.bool
        and mask.shape[0] >= batch
        and tuple(mask.shape[1:]) == (seq_len,)
        and mask.is_contiguous()
    )
    if not fits:
        raise RouteValidationError(
            f"out buffers {tuple(routes.shape)} {routes.dtype} / {tuple(mask.shape)} do not hold "
            f"[{batch}, {seq_len}, {num_layers}, {topk}] {_TORCH_DTYPE[dtype]} routes and a "
            f"[{batch}, {seq_len}] bool mask on CPU"
        )
    return routes[:batch], mask[:batch]


def collate_padded_routes(
    routes: Sequence[np.ndarray | torch.Tensor | None],
    token_counts: Sequence[int],
    *,
    seq_len: int,
    num_layers: int,
    topk: int,
    padding_side: Literal["left", "right"] = "right",
    out: CollatedRoutes | None = None,
) -> CollatedRoutes:
    """One trajectory per row, padded on `padding_side` to `seq_len` (`out` as in
    `collate_routes`)."""
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    placements = []
    for index, count in enumerate(token_counts):
        if not 0 <= count <= seq_len:
            raise RouteValidationError(
                f"trajectory {index}: {count} tokens do not fit a row of {seq_len}"
            )
        start = 0 if padding_side == "right" else seq_len - count
        placements.append(RoutePlacement(trajectory=index, row=index, start=start, length=count))
    return collate_routes(
        routes,
        token_counts,
        placements,
        batch=len(token_counts),
        seq_len=seq_len,
        num_layers=num_layers,
        topk=topk,
        out=out,
    )
