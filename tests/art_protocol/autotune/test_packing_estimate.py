"""The counterfactual packing estimate: shape trees pack like real trajectories, and the chosen
batch respects the spill bound."""

from __future__ import annotations

import numpy as np
import pytest

from art_protocol.autotune import GroupShape, groups_fitting, packed_rows
from art_protocol.packing.inputs import Trajectory, TrajectoryGroup, check_groups
from art_protocol.packing.placement import place_trajectories
from art_protocol.packing.prefix_tree import build_prefix_tree


def real_groups(shapes, rng):
    """Token-level groups of these shapes: a shared prompt, completions that differ at once."""
    groups = []
    for shape in shapes:
        prompt = rng.integers(10, 1000, shape.prefix)
        members = []
        for i, own in enumerate(shape.members):
            completion = rng.integers(10, 1000, own)
            completion[0] = 1000 + i  # distinct first token: branches right after the prompt
            tokens = np.concatenate([prompt, completion])
            mask = np.zeros(len(tokens), bool)
            mask[shape.prefix :] = True
            members.append(Trajectory(tokens=tokens, assistant_mask=mask, advantage=0.5))
        groups.append(TrajectoryGroup(members))
    return groups


def test_shape_trees_pack_into_the_same_rows_as_real_trajectories():
    rng = np.random.default_rng(3)
    shapes = [
        GroupShape(int(rng.integers(100, 3000)), tuple(int(x) for x in rng.integers(50, 2500, 8)))
        for _ in range(24)
    ]
    for seq_len in (8192, 16384):
        trees = [build_prefix_tree(m) for m in check_groups(real_groups(shapes, rng), 2048)]
        assert [t.size for t in trees] == [s.unique_tokens for s in shapes]
        assert packed_rows(shapes, seq_len) == len(place_trajectories(trees, seq_len))


def test_the_chosen_batch_spills_within_the_bound_on_fresh_draws():
    rng = np.random.default_rng(11)
    shapes = [
        GroupShape(
            int(rng.integers(200, 1500)),
            tuple(int(x) for x in rng.lognormal(6, 0.7, 8).clip(10, 4000)),
        )
        for _ in range(64)
    ]
    fit = groups_fitting(shapes, 4, 16384, 0.1, np.random.default_rng(0), samples=40)
    assert fit.groups > 0 and fit.spill_probability <= 0.1

    def spill_rate(groups, draws=100):
        check = np.random.default_rng(99)
        return np.mean(
            [
                packed_rows([shapes[i] for i in check.integers(0, 64, groups)], 16384) > 4
                for _ in range(draws)
            ]
        )

    assert spill_rate(fit.groups) <= 0.2  # the bound, with room for sampling error
    assert spill_rate(fit.groups + 3) > 0.2  # and not far below what fits


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="at least one recent group shape"):
        groups_fitting([], 1, 100, 0.03, np.random.default_rng(0))
    with pytest.raises(ValueError, match="GroupShape needs"):
        GroupShape(10, ())
