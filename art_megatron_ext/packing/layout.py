"""Lay one row's forest out in depth-first preorder.

Why preorder: every node's subtree then occupies one contiguous physical range
`[start, subtree_end)`, so the whole tree-attention mask is one integer per token (see
`attention.py`), and a trajectory's path is a chain of segments in increasing positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from art_protocol.packing.placement import Row
from art_protocol.packing.prefix_tree import PrefixTree


@dataclass(frozen=True)
class Instance:
    """Node `node` of group `group` stored at physical `[start, start + length)` of its row,
    whose subtree (in this row) ends at `subtree_end`; `served` are the group positions of the
    trajectories in this row whose path includes it."""

    group: int
    node: int
    start: int
    length: int
    subtree_end: int
    parent_last: int  # physical position of the parent's last token, -1 for a root
    served: list[int]


def layout_row(row: Row, trees: Sequence[PrefixTree]) -> list[Instance]:
    """The row's node instances in preorder, groups in the order they entered the row."""
    starts: dict[tuple[int, int], int] = {}
    order: list[tuple[int, int]] = []
    cursor = 0
    for group in dict.fromkeys(group for group, _ in row.served):
        tree = trees[group]
        stack = [n for n in reversed(tree.roots) if (group, n) in row.served]
        while stack:
            node = stack.pop()
            starts[(group, node)] = cursor
            order.append((group, node))
            cursor += tree.nodes[node].length
            stack.extend(c for c in reversed(tree.nodes[node].children) if (group, c) in row.served)
    ends: dict[tuple[int, int], int] = {}
    for key in reversed(order):  # children come after their parent in preorder
        group, node = key
        end = starts[key] + trees[group].nodes[node].length
        for child in trees[group].nodes[node].children:
            end = max(end, ends.get((group, child), end))
        ends[key] = end
    instances = []
    for key in order:
        group, node = key
        tree_node = trees[group].nodes[node]
        parent_last = -1
        if tree_node.parent >= 0:
            parent = (group, tree_node.parent)
            parent_last = starts[parent] + trees[group].nodes[tree_node.parent].length - 1
        instances.append(
            Instance(
                group=group,
                node=node,
                start=starts[key],
                length=tree_node.length,
                subtree_end=ends[key],
                parent_last=parent_last,
                served=row.served[key],
            )
        )
    return instances
