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

Multi-turn: a trajectory's routes may arrive as a chain of segments, one per turn (a client
that already holds the earlier turns' rows asks the server only for the new ones). `chain_routes`
checks that each segment's token ids are the trajectory's at its position (a segment from
another conversation or a re-tokenized prompt is refused, naming the trajectory and position),
that segments do not overlap, and returns a `RouteChain` that collation takes in place of an
array: rows no segment covers get the dummy route and padding_mask True. The output dtype is
the widest of all segments' dtypes, decided from the dtypes alone (no pass over the values).
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


@dataclass(frozen=True)
class RouteSegment:
    """Routes of one turn: `rows[i]` is the route of trajectory token `start + i`.
    `token_ids` (same length as `rows`) are the ids the server computed those rows for."""

    start: int
    rows: np.ndarray | torch.Tensor
    token_ids: np.ndarray | Sequence[int] | None = None


@dataclass(frozen=True)
class RouteChain:
    """A trajectory's validated, sorted, non-overlapping segments (`chain_routes`)."""

    length: int  # the trajectory's token count
    segments: tuple[tuple[int, np.ndarray], ...]  # (start, [n, layers, topk]) by start

    @property
    def dtypes(self) -> list[np.dtype]:
        return [rows.dtype for _, rows in self.segments]

    @property
    def covered(self) -> int:
        """Number of tokens that have a captured route."""
        return sum(len(rows) for _, rows in self.segments)


def chain_routes(
    trajectory: int,
    token_ids: np.ndarray | Sequence[int],
    segments: Sequence[RouteSegment],
    *,
    num_layers: int,
    topk: int,
) -> RouteChain:
    """Check a trajectory's route segments against its tokens and chain them.

    Args:
        trajectory: the trajectory's index, for error messages.
        token_ids: the trajectory's token ids (all turns).
        segments: the turns' routes, in any order; a segment without `token_ids` is placed by
            `start` alone.

    Raises:
        RouteValidationError: naming the trajectory, for a segment outside the trajectory, a
            segment whose token ids differ from the trajectory's (with the first position that
            differs), a wrong shape or dtype, or two segments covering the same position.
    """
    tokens = np.asarray(token_ids)
    length = len(tokens)
    checked: list[tuple[int, np.ndarray]] = []
    for number, segment in enumerate(segments):
        what = f"trajectory {trajectory} segment {number} (start {segment.start})"
        rows = _as_numpy(segment.rows, trajectory)
        _check_array(rows, num_layers, topk, what)
        start, n = int(segment.start), rows.shape[0]
        if start < 0 or start + n > length:
            raise RouteValidationError(
                f"{what}: rows for positions [{start}, {start + n}) outside the trajectory's "
                f"{length} tokens"
            )
        if segment.token_ids is not None:
            ids = np.asarray(segment.token_ids)
            if ids.shape != (n,):
                raise RouteValidationError(
                    f"{what}: {ids.shape[0] if ids.ndim else 0} token ids for {n} route rows"
                )
            differ = np.flatnonzero(ids != tokens[start : start + n])
            if differ.size:
                at = start + int(differ[0])
                raise RouteValidationError(
                    f"{what}: token ids do not align at position {at}: the segment has "
                    f"{int(ids[differ[0]])}, the trajectory has {int(tokens[at])}"
                )
        if n:
            checked.append((start, rows))
    checked.sort(key=lambda item: item[0])
    for (a_start, a_rows), (b_start, _) in itertools.pairwise(checked):
        if b_start < a_start + len(a_rows):
            raise RouteValidationError(
                f"trajectory {trajectory}: segments starting at {a_start} and {b_start} both "
                f"cover position {b_start}"
            )
    return RouteChain(length=length, segments=tuple(checked))


def _check_array(array: np.ndarray, num_layers: int, topk: int, what: str) -> None:
    if array.dtype not in _RANK:
        raise RouteValidationError(
            f"{what}: routes dtype {array.dtype} is not one of uint8, int16, uint16, int32"
        )
    if array.ndim != 3 or array.shape[1:] != (num_layers, topk):
        raise RouteValidationError(
            f"{what}: routes shape {tuple(array.shape)} is not [tokens, {num_layers}, {topk}]"
        )


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


Segments = tuple[tuple[int, np.ndarray], ...]


def _validate(
    routes: Sequence[np.ndarray | torch.Tensor | RouteChain | None],
    token_counts: Sequence[int],
    num_layers: int,
    topk: int,
) -> tuple[list[Segments], np.dtype]:
    """Check every trajectory's routes (shape, dtype, length) from metadata only, and pick the
    output dtype from the dtypes alone: promotion never needs a scan of the values.
    Returns each trajectory's `(start, rows)` segments, sorted and non-overlapping."""
    if len(routes) != len(token_counts):
        raise RouteValidationError(
            f"{len(routes)} route arrays for {len(token_counts)} trajectories (token counts)"
        )
    segments: list[Segments] = []
    rank = 0
    for index, (array, count) in enumerate(zip(routes, token_counts, strict=True)):
        if array is None:
            segments.append(())
            continue
        if isinstance(array, RouteChain):
            if array.length != count:
                raise RouteValidationError(
                    f"trajectory {index}: its route chain was built for {array.length} tokens, "
                    f"the trajectory has {count}"
                )
            for dtype in array.dtypes:
                rank = max(rank, _RANK[dtype])
            for _, rows in array.segments:  # a chain from another model shape
                _check_array(rows, num_layers, topk, f"trajectory {index}")
            segments.append(array.segments)
            continue
        array = _as_numpy(array, index)
        _check_array(array, num_layers, topk, f"trajectory {index}")
        if array.shape[0] > count:
            raise RouteValidationError(
                f"trajectory {index}: routes cover {array.shape[0]} tokens but the trajectory "
                f"has {count}"
            )
        rank = max(rank, _RANK[array.dtype])
        segments.append(((0, array),))
    return segments, _OUTPUT[rank]


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
    routes: Sequence[np.ndarray | torch.Tensor | RouteChain | None],
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
            int16, uint16 or int32; a mixed batch is promoted), a `RouteChain` of several turns'
            segments (`chain_routes`), or None if none were captured. Tokens no route covers
            (an uncaptured suffix, a gap between turns) get the dummy route and padding_mask
            True.
        token_counts: each trajectory's token count, to validate `n_i` and placements against.
        placements: where each trajectory's tokens go; placements in a row must not overlap.
        out: buffers from an earlier call to write into instead of allocating (their first
            `batch` rows are used and returned as views). On this CPU, first-touch page faults
            of a fresh 0.5 GB tensor cost about 5x the copy itself (`bench/route_collation.py`),
            so a trainer that keeps the buffer across steps pays only the copy.
    """
    segments, dtype = _validate(routes, token_counts, num_layers, topk)
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
            # Source tokens [p.source_start, end) go to positions offset by `shift`.
            shift, end = p.start - p.source_start, p.source_start + p.length
            at = p.source_start  # next source token to write
            for seg_start, rows_ in segments[p.trajectory]:
                lo, hi = max(seg_start, at), min(seg_start + len(rows_), end)
                if hi <= lo:
                    continue
                fill_dummy(row_index, at + shift, lo + shift)
                np.copyto(
                    out_np[row_index, lo + shift : hi + shift],
                    rows_[lo - seg_start : hi - seg_start],
                    casting="safe",
                )
                mask_np[row_index, lo + shift : hi + shift] = False
                at = hi
            fill_dummy(row_index, at + shift, end + shift)
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
        # numpy, not torch.empty: numpy asks the kernel for transparent huge pages on large
        # arrays (madvise), which cuts first-touch page faults of a fresh 0.5 GB tensor ~170x
        # and its CPU time about 1.8x here (bench/route_pipeline.py); torch.from_numpy shares it.
        routes = torch.from_numpy(np.empty((batch, seq_len, num_layers, topk), dtype=dtype))
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
    routes: Sequence[np.ndarray | torch.Tensor | RouteChain | None],
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
