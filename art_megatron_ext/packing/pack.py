"""Pack trajectory groups into fixed-length training rows with shared prefixes stored once.

The pipeline: validate (`inputs.py`) -> one prefix tree per group (`prefix_tree.py`) -> place
trajectories into rows (`placement.py`) -> lay each row out in preorder (`layout.py`) -> write
the per-token tensors (here, one allocation each, every element written once) -> collate the
routes into the same positions (`routing/collate.py`).

The attention rule is carried by one integer per token, `subtree_end`: key `j` is visible to
query `i` iff `j <= i < subtree_end[j]` (see `attention.py`). Because a branch does not follow
its parent physically, the logits that predict token `i` sit at `predecessor[i]` (the previous
token of the same trajectory), not at `i - 1`. A trajectory's first token and padding have
`predecessor == -1`; neither is ever trained (a trained first token is refused as input), so a
trainer gathering logits at `predecessor` where `assistant_mask` is True never reads index -1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from art_megatron_ext.packing.layout import Instance, layout_row
from art_megatron_ext.routing.collate import CollatedRoutes, RoutePlacement, collate_routes
from art_protocol.packing.inputs import CheckedTrajectory, TrajectoryGroup, check_groups
from art_protocol.packing.placement import place_trajectories
from art_protocol.packing.prefix_tree import PrefixTree, build_prefix_tree


@dataclass(frozen=True)
class PackingConfig:
    """How to pack: row length, vocabulary bound for id checks, and the padding token."""

    seq_len: int
    vocab_size: int
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        if self.seq_len < 1 or self.vocab_size < 1:
            raise ValueError(f"seq_len and vocab_size must be >= 1, got {self}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id {self.pad_token_id} outside [0, {self.vocab_size})")


@dataclass(frozen=True)
class PackingStats:
    """logical: sum of trajectory lengths; unique: tokens of all prefix trees (the ideal
    storage); physical: tokens stored in rows (unique plus prefixes repeated across rows)."""

    logical_tokens: int
    unique_tokens: int
    physical_tokens: int
    rows: int
    seq_len: int

    @property
    def lower_bound_rows(self) -> int:
        """No packing can use fewer rows than the ideal storage needs."""
        return math.ceil(self.unique_tokens / self.seq_len)

    @property
    def efficiency(self) -> float:
        """Ideal storage over the storage used: 1.0 means no padding and no repeats."""
        return self.unique_tokens / (self.rows * self.seq_len) if self.rows else 1.0


@dataclass
class PackedTokens:
    """Per-token tensors, all `[rows, seq_len]`. A token shared by several trajectories is
    trained if any of them trains it, with their summed weight. Padding: segment -1, attends
    only to itself, predecessor -1, assistant_mask False, logprob NaN, advantage, weight 0."""

    tokens: np.ndarray  # int64
    input_pos: np.ndarray  # int64, position within the trajectory (for RoPE / embeddings)
    segment_ids: np.ndarray  # int32, one id per stored node instance, -1 on padding
    subtree_end: np.ndarray  # int32, see the module docstring
    predecessor: np.ndarray  # int32, -1 for a trajectory's first token and for padding;
    # never -1 where assistant_mask is True (inputs.py refuses a trained first token)
    assistant_mask: np.ndarray  # bool
    logprobs: np.ndarray  # float32, NaN where none
    advantages: np.ndarray  # float32
    weights: np.ndarray  # float32, summed over the trajectories that train the token, else 0

    @classmethod
    def empty(cls, rows: int, seq_len: int) -> PackedTokens:
        dtypes = [np.int64, np.int64, np.int32, np.int32, np.int32, np.bool_] + [np.float32] * 3
        return cls(*(np.empty((rows, seq_len), dtype=d) for d in dtypes))

    def as_torch(self) -> dict[str, torch.Tensor]:
        return {f.name: torch.from_numpy(getattr(self, f.name)) for f in fields(self)}


@dataclass(frozen=True)
class PackedBatch:
    """The packed rows. `trajectory_positions[k] = (row, positions)` says where flat trajectory
    k's tokens sit, in order (shared prefix tokens included), to gather its results back."""

    tokens: torch.Tensor
    input_pos: torch.Tensor
    segment_ids: torch.Tensor
    subtree_end: torch.Tensor
    predecessor: torch.Tensor
    assistant_mask: torch.Tensor
    logprobs: torch.Tensor
    advantages: torch.Tensor
    weights: torch.Tensor
    routes: CollatedRoutes | None
    trajectory_positions: list[tuple[int, np.ndarray]]
    stats: PackingStats


def _route_source(sharers: list[CheckedTrajectory], end: int) -> CheckedTrajectory:
    """The sharer whose recorded routes cover the most of a node ending at `end` (routes of a
    shared prefix are one forward's routes, so any full copy will do)."""
    return max(sharers, key=lambda t: 0 if t.routes is None else min(end, t.routes.shape[0]))


def _write_instance(
    out: PackedTokens, row: int, inst: Instance, tree: PrefixTree, segment: int
) -> None:
    """Write one node instance. Training fields come from the trajectories this row serves
    through it (see `prefix_tree.py` for why that is exact)."""
    node = tree.nodes[inst.node]
    a, b = inst.start, inst.start + inst.length
    src = slice(node.start, node.end)
    out.tokens[row, a:b] = node.owner.tokens[src]
    out.input_pos[row, a:b] = np.arange(node.start, node.end)
    out.segment_ids[row, a:b] = segment
    out.subtree_end[row, a:b] = inst.subtree_end
    out.predecessor[row, a] = inst.parent_last
    out.predecessor[row, a + 1 : b] = np.arange(a, b - 1)
    first, *others = (tree.members[m] for m in inst.served)
    mask, logprobs = out.assistant_mask[row, a:b], out.logprobs[row, a:b]
    advantages, weights = out.advantages[row, a:b], out.weights[row, a:b]
    mask[:] = first.assistant_mask[src]
    logprobs[:] = first.logprobs[src]
    advantages[:] = first.advantages[src]
    np.multiply(first.weights[src], mask, out=weights)
    for member in others:
        trains = member.assistant_mask[src]
        if trains.any():
            mask |= trains
            logprobs[trains] = member.logprobs[src][trains]
            advantages[trains] = member.advantages[src][trains]
            weights += member.weights[src] * trains


def _write_padding(out: PackedTokens, row: int, start: int, pad_token_id: int) -> None:
    seq_len = out.tokens.shape[1]
    out.tokens[row, start:] = pad_token_id
    out.input_pos[row, start:] = 0
    out.segment_ids[row, start:] = -1
    out.subtree_end[row, start:] = np.arange(start + 1, seq_len + 1)
    out.predecessor[row, start:] = -1
    out.assistant_mask[row, start:] = False
    out.logprobs[row, start:] = np.nan
    out.advantages[row, start:] = 0.0
    out.weights[row, start:] = 0.0


def pack_groups(
    groups: Sequence[TrajectoryGroup],
    config: PackingConfig,
    *,
    route_buffer: CollatedRoutes | None = None,
) -> PackedBatch:
    """Validate, share prefixes, place and write; see the module docstring.

    `route_buffer`: route tensors from an earlier batch to reuse (see `collate_routes(out=)`);
    the routes are written into its first rows.
    """
    checked = check_groups(groups, config.vocab_size)
    flat = [t for members in checked for t in members]
    trees = [build_prefix_tree(members) for members in checked]
    rows = place_trajectories(trees, config.seq_len)
    out = PackedTokens.empty(len(rows), config.seq_len)
    route_shape = next((t.routes.shape[1:] for t in flat if t.routes is not None), None)
    route_placements: list[RoutePlacement] = []
    positions: list[tuple[int, np.ndarray]] = [(-1, np.empty(0, np.int64))] * len(flat)
    physical = segment = 0
    for r, row in enumerate(rows):
        instances = layout_row(row, trees)
        start_of = {}
        for inst in instances:
            tree = trees[inst.group]
            _write_instance(out, r, inst, tree, segment)
            segment += 1
            start_of[(inst.group, inst.node)] = inst.start
            if route_shape is not None:
                node = tree.nodes[inst.node]
                source = _route_source([tree.members[m] for m in inst.served], node.end)
                route_placements.append(
                    RoutePlacement(source.index, r, inst.start, inst.length, node.start)
                )
        used = instances[-1].start + instances[-1].length
        _write_padding(out, r, used, config.pad_token_id)
        physical += used
        for group, member in row.members:
            tree = trees[group]
            pieces = [
                np.arange(start_of[(group, n)], start_of[(group, n)] + tree.nodes[n].length)
                for n in tree.paths[member]
            ]
            positions[tree.members[member].index] = (r, np.concatenate(pieces))

    routes = None
    if route_shape is not None:
        routes = collate_routes(
            [t.routes for t in flat],
            [t.length for t in flat],
            route_placements,
            batch=len(rows),
            seq_len=config.seq_len,
            num_layers=route_shape[0],
            topk=route_shape[1],
            out=route_buffer,
        )
    stats = PackingStats(
        logical_tokens=sum(t.length for t in flat),
        unique_tokens=sum(tree.size for tree in trees),
        physical_tokens=physical,
        rows=len(rows),
        seq_len=config.seq_len,
    )
    return PackedBatch(**out.as_torch(), routes=routes, trajectory_positions=positions, stats=stats)
