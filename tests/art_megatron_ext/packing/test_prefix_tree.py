"""The prefix tree shares exactly the tokens whose loss is identical for every sharer."""

import numpy as np

from art_megatron_ext.packing import Trajectory
from art_protocol.packing.inputs import check_trajectory
from art_protocol.packing.prefix_tree import build_prefix_tree


def _checked(trajectories):
    return [
        check_trajectory(t, index=i, group=0, position=i, vocab_size=100)
        for i, t in enumerate(trajectories)
    ]


def _traj(tokens, trained_from, advantage=1.0, logprob=-0.5):
    tokens = np.asarray(tokens)
    mask = np.arange(len(tokens)) >= trained_from
    logprobs = np.where(mask, logprob, np.nan).astype(np.float32)
    return Trajectory(tokens, mask, logprobs, advantage=advantage)


def _segments(tree, member):
    return [(tree.nodes[n].start, tree.nodes[n].end) for n in tree.paths[member]]


def test_rollouts_of_one_prompt_share_the_prompt_once():
    prompt = [1, 2, 3, 4]
    tree = build_prefix_tree(
        _checked([_traj([*prompt, 5, 6], 4), _traj([*prompt, 7], 4), _traj([*prompt, 8, 9, 9], 4)])
    )
    assert tree.size == 4 + 2 + 1 + 3
    assert [_segments(tree, m) for m in range(3)] == [
        [(0, 4), (4, 6)],
        [(0, 4), (4, 5)],
        [(0, 4), (4, 7)],
    ]
    assert len(tree.roots) == 1


def test_equal_trained_tokens_share_beyond_the_prompt():
    tree = build_prefix_tree(_checked([_traj([1, 2, 3, 4, 5], 2), _traj([1, 2, 3, 4, 6], 2)]))
    assert _segments(tree, 0) == [(0, 4), (4, 5)]


def test_trained_tokens_with_different_advantages_branch_even_with_equal_ids():
    tree = build_prefix_tree(
        _checked([_traj([1, 2, 3, 4], 2, advantage=1.0), _traj([1, 2, 3, 4], 2, advantage=-1.0)])
    )
    assert _segments(tree, 0) == [(0, 2), (2, 4)]
    assert _segments(tree, 1) == [(0, 2), (2, 4)]
    assert tree.paths[0][1] != tree.paths[1][1]


def test_trained_tokens_with_different_logprobs_branch():
    tree = build_prefix_tree(
        _checked([_traj([1, 2, 3], 1, logprob=-0.5), _traj([1, 2, 3], 1, logprob=-0.25)])
    )
    assert tree.size == 1 + 2 + 2


def test_context_in_one_and_trained_in_another_is_shared():
    """Multi-turn: turn 1's answer is trained in history 1 and context in history 2."""
    first = _traj([1, 2, 3, 4], trained_from=2)  # prompt 1 2, answer 3 4
    second = _traj([1, 2, 3, 4, 5, 6, 7], trained_from=6)  # ..., user 5 6, answer 7
    tree = build_prefix_tree(_checked([first, second]))
    assert tree.size == 7
    assert _segments(tree, 0) == [(0, 4)]
    assert _segments(tree, 1) == [(0, 4), (4, 7)]


def test_a_trajectory_that_is_a_prefix_of_another_ends_on_a_node_boundary():
    tree = build_prefix_tree(_checked([_traj([1, 2, 3, 4, 5], 5), _traj([1, 2, 3], 3)]))
    assert _segments(tree, 1) == [(0, 3)]
    assert _segments(tree, 0) == [(0, 3), (3, 5)]


def test_identical_trajectories_share_everything():
    tree = build_prefix_tree(_checked([_traj([1, 2, 3], 1), _traj([1, 2, 3], 1)]))
    assert tree.size == 3 and tree.paths[0] == tree.paths[1]


def test_no_common_first_token_gives_separate_roots():
    tree = build_prefix_tree(_checked([_traj([1, 2], 1), _traj([3, 4], 1)]))
    assert len(tree.roots) == 2 and tree.size == 4
