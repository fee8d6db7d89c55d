"""Placement invariants on random batches: every trajectory is placed once, with its full path
in its row, and no row holds more than seq_len tokens."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from art_megatron_ext.packing import Trajectory
from art_protocol.packing.inputs import check_trajectory
from art_protocol.packing.placement import place_trajectories
from art_protocol.packing.prefix_tree import build_prefix_tree


@st.composite
def _batches(draw):
    """Groups of rollouts behind a shared prompt; suffixes either share structure (few
    distinct ids) or are distinct per member, with lengths up to the row length."""
    seq_len = draw(st.integers(8, 40))
    groups = []
    index = 0
    for g in range(draw(st.integers(1, 8))):
        prompt = [g + 1] * draw(st.integers(1, 6))
        members = []
        for position in range(draw(st.integers(1, 6))):
            length = draw(st.integers(0, seq_len))
            if draw(st.booleans()):
                suffix = draw(st.lists(st.integers(0, 3), min_size=length, max_size=length))
            else:
                suffix = [20 + position] * length
            tokens = np.array((prompt + suffix)[:seq_len])
            trajectory = Trajectory(tokens, np.zeros(len(tokens), bool))
            members.append(
                check_trajectory(
                    trajectory, index=index, group=g, position=position, vocab_size=100
                )
            )
            index += 1
        groups.append(members)
    return seq_len, groups


@settings(max_examples=200, deadline=None)
@given(_batches())
def test_rows_hold_full_paths_and_never_overflow(batch):
    seq_len, groups = batch
    trees = [build_prefix_tree(members) for members in groups]
    rows = place_trajectories(trees, seq_len)
    placed = sorted((g, m) for row in rows for g, m in row.members)
    assert placed == sorted(
        (g, m) for g, tree in enumerate(trees) for m in range(len(tree.members))
    )
    for row in rows:
        stored = sum(trees[g].nodes[n].length for g, n in row.served)
        assert stored == row.used <= seq_len
        for g, m in row.members:
            assert all((g, n) in row.served for n in trees[g].paths[m])


def _group(g, prompt_len, completion_lens, index):
    members = []
    for position, n in enumerate(completion_lens):
        tokens = np.array([g + 1] * prompt_len + [position + 20] * n)
        trajectory = Trajectory(tokens, np.zeros(len(tokens), bool))
        members.append(
            check_trajectory(
                trajectory, index=index + position, group=g, position=position, vocab_size=100
            )
        )
    return members


def test_a_group_larger_than_a_row_is_never_placed_whole_by_its_partial_cost():
    """Regression: group 1 (1 + 11 + 11 = 23 tokens > 20) must not go whole into the row with
    12 free tokens that group 0's remainder left, although one of its members fits there."""
    trees = [
        build_prefix_tree(_group(0, 1, [15, 7], 0)),
        build_prefix_tree(_group(1, 1, [11, 11], 2)),
    ]
    rows = place_trajectories(trees, 20)
    for row in rows:
        assert sum(trees[g].nodes[n].length for g, n in row.served) <= 20


def test_random_batches_of_groups_larger_than_a_row():
    """Seeded sweep of batches whose groups often exceed a row (the case that forces splits)."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        seq_len = int(rng.integers(10, 40))
        trees, index = [], 0
        for g in range(int(rng.integers(2, 7))):
            prompt_len = int(rng.integers(1, 6))
            lens = rng.integers(1, seq_len - prompt_len + 1, size=int(rng.integers(1, 5)))
            trees.append(build_prefix_tree(_group(g, prompt_len, lens.tolist(), index)))
            index += len(lens)
        rows = place_trajectories(trees, seq_len)
        for row in rows:
            assert sum(trees[g].nodes[n].length for g, n in row.served) == row.used <= seq_len
            for g, m in row.members:
                assert all((g, n) in row.served for n in trees[g].paths[m])
        assert sum(len(row.members) for row in rows) == index
