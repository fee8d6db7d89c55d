"""How many trajectory groups fit a row budget: a counterfactual run of the project's packer.

Why: the trainer pays for whole packed rows. A batch of G groups that needs one row more than
planned pays a nearly empty row (or waits longer for the next batch), so the tuner picks the
largest G whose probability of spilling past R rows stays under a bound (e.g. 3%). That
probability depends on the real shapes (prompt shared by a group, spread of completion
lengths), so it is estimated by packing random batches drawn from recent real group shapes
with `art_protocol.packing.placement` on prefix trees built from the shapes alone (no
token ids: shapes carry all the packer looks at). numpy only; seeded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from art_protocol.packing.placement import place_trajectories
from art_protocol.packing.prefix_tree import Node, PrefixTree

_EMPTY_BOOL = np.zeros(0, dtype=bool)
_EMPTY_F32 = np.zeros(0, dtype=np.float32)


@dataclass(frozen=True)
class GroupShape:
    """One trajectory group's shape: a prefix shared by every member (the prompt, or the
    history of a multi-turn chat) and each member's length after it (its own tokens)."""

    prefix: int
    members: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.prefix < 0 or not self.members or min(self.members) < 1:
            raise ValueError(
                f"GroupShape needs prefix >= 0 and at least one member of >= 1 token, got {self}"
            )

    @property
    def unique_tokens(self) -> int:
        return self.prefix + sum(self.members)

    @property
    def longest(self) -> int:
        return self.prefix + max(self.members)


@dataclass(frozen=True)
class _Member:
    """What placement reads of a trajectory: its length and a name for errors."""

    length: int
    name: str


def _node(start: int, end: int, parent: int) -> Node:
    return Node(
        owner=None,  # placement reads only lengths and paths
        start=start,
        end=end,
        parent=parent,
        mask=_EMPTY_BOOL,
        logprobs=_EMPTY_F32,
        advantages=_EMPTY_F32,
    )


def shape_tree(shape: GroupShape, name: str = "group") -> PrefixTree:
    """The prefix tree the packer would build for a group of this shape."""
    nodes: list[Node] = []
    roots: list[int] = []
    if shape.prefix:
        nodes.append(_node(0, shape.prefix, -1))
        roots.append(0)
    paths, members = [], []
    for i, own in enumerate(shape.members):
        parent = 0 if shape.prefix else -1
        nodes.append(_node(shape.prefix, shape.prefix + own, parent))
        node_id = len(nodes) - 1
        if parent >= 0:
            nodes[0].children.append(node_id)
        else:
            roots.append(node_id)
        nodes[node_id].terminals.append(i)
        paths.append([0, node_id] if shape.prefix else [node_id])
        members.append(_Member(shape.prefix + own, f"{name} member {i}"))
    return PrefixTree(members=members, nodes=nodes, roots=roots, paths=paths)


@lru_cache(maxsize=8192)
def _cached_tree(shape: GroupShape) -> PrefixTree:
    """Trees are only read by placement, so one per distinct shape serves every batch."""
    return shape_tree(shape)


def packed_rows(shapes: Sequence[GroupShape], seq_len: int) -> int:
    """Rows the project's packer uses for these groups (raises if a member exceeds a row)."""
    for i, shape in enumerate(shapes):
        if shape.longest > seq_len:
            raise ValueError(
                f"group {i}: a member of {shape.longest} tokens does not fit a row of {seq_len}"
            )
    return len(place_trajectories([_cached_tree(s) for s in shapes], seq_len))


@dataclass(frozen=True)
class FitEstimate:
    """`groups`: the largest batch whose spill probability past `rows` is <= the bound;
    `spill_probability`: its estimate; `samples`: batches packed per candidate."""

    rows: int
    groups: int
    spill_probability: float
    samples: int


def groups_fitting(
    shapes: Sequence[GroupShape],
    rows: int,
    seq_len: int,
    spill_bound: float,
    rng: np.random.Generator,
    samples: int = 32,
    max_groups: int = 512,
) -> FitEstimate:
    """The largest G in [1, max_groups] such that a batch of G groups drawn (with replacement)
    from `shapes` needs more than `rows` rows in at most `spill_bound` of `samples` draws.
    G = 0 when even one group spills that often. Each draw's capacity (the most groups of its
    random order that fit) is found by walking down from the token lower bound with the
    packer; G is the spill-bound quantile of the capacities."""
    if not shapes:
        raise ValueError("groups_fitting needs at least one recent group shape")
    if rows < 1 or seq_len < 1:
        raise ValueError(f"rows and seq_len must be >= 1, got rows={rows} seq_len={seq_len}")
    capacities = np.empty(samples, dtype=np.int64)
    budget = rows * seq_len
    for k in range(samples):
        order = [shapes[i] for i in rng.integers(0, len(shapes), size=max_groups)]
        # no packing beats the lower bound ceil(unique / seq_len): start there and walk down
        # (the packer reaches the bound or one row more, so this takes a few packs)
        cumulative = np.cumsum([s.unique_tokens for s in order])
        hi = int(np.searchsorted(cumulative, budget, side="right"))
        while hi > 0 and packed_rows(order[:hi], seq_len) > rows:
            hi -= 1
        capacities[k] = hi
    # G spills in draw k iff capacities[k] < G; allowed spills: floor(bound * samples)
    allowed = int(np.floor(spill_bound * samples + 1e-9))
    ordered = np.sort(capacities)
    groups = int(ordered[allowed]) if allowed < samples else int(ordered[-1])
    spill = float(np.mean(capacities < groups)) if groups else 0.0
    return FitEstimate(rows=rows, groups=groups, spill_probability=spill, samples=samples)
