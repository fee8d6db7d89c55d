"""The prefix tree (a radix tree over token positions) of one trajectory group.

Why: rollouts of one prompt share the prompt; turns of one chat share the history. Stored once,
a shared prefix costs its tokens once in the packed batch instead of once per trajectory.

When trajectories may share a token: the whole prefix up to and including it has equal token
ids (so the model computes the same thing there), AND every sharer that trains on it
(`assistant_mask` True) has the same sampling logprob (NaN equals NaN) and advantage. Sharers
that do not train on it only use it as context. Then storing the token once, trained if any
sharer trains it, with the summed weight of its trainers, gives exactly the loss of storing it
once per sharer, for any per-token objective (clipped or not). Where two trainers disagree the
trajectories branch even though the ids agree. A multi-turn history whose earlier assistant
turns are context in the later trajectory but trained in the earlier one therefore still
shares them.

A node is a segment `[start, end)` of logical positions; its token ids come from its owner (the
first trajectory that reached it). It also keeps the merged training view (mask, logprobs,
advantages) used to test newcomers; the values written to a row come from the trajectories that
row serves (`pack.py`), not from this view. Every trajectory ends on a node boundary (its
terminal node), so its path is the chain of parents from there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from art_protocol.packing.inputs import CheckedTrajectory


@dataclass
class Node:
    owner: CheckedTrajectory
    start: int
    end: int
    parent: int  # node id, -1 for a root
    mask: np.ndarray  # merged training view over [start, end): any sharer trains the token
    logprobs: np.ndarray  # where mask: the trainers' common logprob
    advantages: np.ndarray  # where mask: the trainers' common advantage
    children: list[int] = field(default_factory=list)
    terminals: list[int] = field(default_factory=list)  # group positions ending here
    owns_view: bool = False  # False while mask/logprobs/advantages are views of the owner

    @property
    def length(self) -> int:
        return self.end - self.start


def _first_true(flags: np.ndarray) -> int:
    """Index of the first True, or len(flags) when there is none."""
    if flags.size == 0:
        return 0
    index = int(flags.argmax())
    return index if flags[index] else flags.size


def _new_node(trajectory: CheckedTrajectory, start: int, end: int, parent: int) -> Node:
    span = slice(start, end)
    return Node(
        owner=trajectory,
        start=start,
        end=end,
        parent=parent,
        mask=trajectory.assistant_mask[span],
        logprobs=trajectory.logprobs[span],
        advantages=trajectory.advantages[span],
    )


def _shareable_length(node: Node, other: CheckedTrajectory, end: int) -> int:
    """How many positions from `node.start` (up to `end`) `other` may share with `node`."""
    start = node.start
    count = _first_true(node.owner.tokens[start:end] != other.tokens[start:end])
    both = node.mask[:count] & other.assistant_mask[start : start + count]
    if not both.any():
        return count
    lp_a, lp_b = node.logprobs[:count], other.logprobs[start : start + count]
    lp_differs = (lp_a != lp_b) & ~(np.isnan(lp_a) & np.isnan(lp_b))
    adv_differs = node.advantages[:count] != other.advantages[start : start + count]
    return _first_true(both & (lp_differs | adv_differs))


def _merge_training_view(node: Node, other: CheckedTrajectory) -> None:
    """After `other` shares all of `node`: record the tokens only `other` trains."""
    span = slice(node.start, node.end)
    new = other.assistant_mask[span] & ~node.mask
    if not new.any():
        return
    if not node.owns_view:
        node.mask, node.logprobs = node.mask.copy(), node.logprobs.copy()
        node.advantages, node.owns_view = node.advantages.copy(), True
    node.mask |= new
    node.logprobs[new] = other.logprobs[span][new]
    node.advantages[new] = other.advantages[span][new]


@dataclass
class PrefixTree:
    """The radix tree of one group; `paths[i]` lists the node ids of member i, root first."""

    members: Sequence[CheckedTrajectory]
    nodes: list[Node]
    roots: list[int]
    paths: list[list[int]]

    @property
    def size(self) -> int:
        """Tokens stored when the whole group sits in one row."""
        return sum(node.length for node in self.nodes)


def _split(nodes: list[Node], node_id: int, at: int) -> None:
    """Cut node `node_id` at logical position `at`; the tail keeps children and terminals."""
    node = nodes[node_id]
    cut = at - node.start
    tail = Node(
        owner=node.owner,
        start=at,
        end=node.end,
        parent=node_id,
        mask=node.mask[cut:],
        logprobs=node.logprobs[cut:],
        advantages=node.advantages[cut:],
        children=node.children,
        terminals=node.terminals,
    )
    tail_id = len(nodes)
    nodes.append(tail)
    for child in tail.children:
        nodes[child].parent = tail_id
    node.end, node.children, node.terminals = at, [tail_id], []
    if node.owns_view:  # keep head and tail independent of each other's later merges
        node.mask, node.logprobs = node.mask[:cut].copy(), node.logprobs[:cut].copy()
        node.advantages = node.advantages[:cut].copy()
        tail.mask, tail.logprobs = tail.mask.copy(), tail.logprobs.copy()
        tail.advantages, tail.owns_view = tail.advantages.copy(), True
    else:
        node.mask, node.logprobs = node.mask[:cut], node.logprobs[:cut]
        node.advantages = node.advantages[:cut]


def build_prefix_tree(members: Sequence[CheckedTrajectory]) -> PrefixTree:
    """Insert the group's trajectories in order; the first one to reach a segment owns it."""
    nodes: list[Node] = []
    roots: list[int] = []
    for position, trajectory in enumerate(members):
        length = trajectory.length
        pos, parent, siblings = 0, -1, roots
        while True:
            match_id, matched = -1, 0
            for child_id in siblings:
                matched = _shareable_length(
                    nodes[child_id], trajectory, min(nodes[child_id].end, length)
                )
                if matched:
                    match_id = child_id
                    break
            if match_id < 0:
                nodes.append(_new_node(trajectory, pos, length, parent))
                nodes[-1].terminals.append(position)
                siblings.append(len(nodes) - 1)
                break
            child = nodes[match_id]
            if pos + matched < child.end:
                _split(nodes, match_id, pos + matched)
            _merge_training_view(child, trajectory)
            pos += matched
            if pos == length:
                child.terminals.append(position)
                break
            parent, siblings = match_id, child.children
    terminal_of = {t: node_id for node_id, node in enumerate(nodes) for t in node.terminals}
    paths = []
    for position in range(len(members)):
        path, node_id = [], terminal_of[position]
        while node_id >= 0:
            path.append(node_id)
            node_id = nodes[node_id].parent
        paths.append(path[::-1])
    return PrefixTree(members=members, nodes=nodes, roots=roots, paths=paths)
