"""What pack_groups writes: every trajectory is recoverable from its positions, predecessors
chain its tokens, weights add up over sharers, padding is inert, routes follow the tokens, and
placement respects the row length and the lower bound."""

import math

import numpy as np
import pytest
import torch

from art_megatron_ext.packing import (
    PackingConfig,
    Trajectory,
    TrajectoryGroup,
    pack_groups,
    tree_attention_mask,
)

from .builders import LAYERS, TOPK, VOCAB, routes_for


def _flat(groups):
    return [t for g in groups for t in g.trajectories]


def _batch(rng, single_turn_group, multi_turn_group, with_routes=False):
    return [
        single_turn_group(rng, with_routes=with_routes),
        multi_turn_group(rng, with_routes=with_routes),
        single_turn_group(rng, prompt_len=3, completion_lens=(7,), with_routes=with_routes),
        single_turn_group(rng, prompt_len=5, completion_lens=(2, 2, 6, 1), with_routes=with_routes),
    ]


@pytest.mark.parametrize("seq_len", [64, 20])  # 20 forces groups to be split across rows
def test_every_trajectory_is_recoverable_from_its_positions(
    seq_len, single_turn_group, multi_turn_group
):
    rng = np.random.default_rng(0)
    groups = _batch(rng, single_turn_group, multi_turn_group)
    packed = pack_groups(groups, PackingConfig(seq_len=seq_len, vocab_size=VOCAB))
    for k, trajectory in enumerate(_flat(groups)):
        row, positions = packed.trajectory_positions[k]
        n = len(trajectory.tokens)
        np.testing.assert_array_equal(packed.tokens[row, positions].numpy(), trajectory.tokens)
        np.testing.assert_array_equal(packed.input_pos[row, positions].numpy(), np.arange(n))
        expected_predecessors = np.concatenate([[-1], positions[:-1]])
        np.testing.assert_array_equal(
            packed.predecessor[row, positions].numpy(), expected_predecessors
        )
        trained = trajectory.assistant_mask
        assert packed.assistant_mask[row, positions].numpy()[trained].all()
        np.testing.assert_array_equal(
            packed.logprobs[row, positions].numpy()[trained], trajectory.logprobs[trained]
        )
        np.testing.assert_array_equal(
            packed.advantages[row, positions].numpy()[trained],
            np.broadcast_to(np.float32(trajectory.advantage), n)[trained],
        )
        # Its own positions form a causal chain that the mask lets it see, and nothing else.
        mask = tree_attention_mask(packed.subtree_end[row])
        visible = mask[positions[-1]].nonzero().flatten().numpy()
        np.testing.assert_array_equal(visible, positions)


@pytest.mark.parametrize("seq_len", [64, 20])
def test_every_trained_token_has_a_predecessor_inside_its_row(
    seq_len, single_turn_group, multi_turn_group
):
    """Where assistant_mask is True, predecessor is a real earlier position of the row (never
    the -1 of a first token or padding), so gathering logits there is always in range."""
    rng = np.random.default_rng(6)
    packed = pack_groups(
        _batch(rng, single_turn_group, multi_turn_group),
        PackingConfig(seq_len=seq_len, vocab_size=VOCAB),
    )
    trained = packed.assistant_mask
    assert trained.any()
    predecessor = packed.predecessor[trained]
    assert (predecessor >= 0).all()
    rows, cols = trained.nonzero(as_tuple=True)
    assert (predecessor < cols).all()
    assert (packed.segment_ids[rows, predecessor.long()] >= 0).all()


def test_weights_sum_over_the_trajectories_that_train_a_shared_token():
    tokens = np.array([1, 2, 3, 4])
    mask = np.array([False, False, True, True])
    lp = np.array([np.nan, np.nan, -0.5, -0.5], np.float32)
    same = [Trajectory(tokens, mask, lp, advantage=1.0, weight=w) for w in (0.5, 2.0)]
    packed = pack_groups([TrajectoryGroup(same)], PackingConfig(seq_len=8, vocab_size=VOCAB))
    assert packed.stats.physical_tokens == 4
    assert packed.weights[0, :4].tolist() == [0.0, 0.0, 2.5, 2.5]


def test_padding_is_inert(single_turn_group):
    rng = np.random.default_rng(1)
    packed = pack_groups([single_turn_group(rng)], PackingConfig(seq_len=40, vocab_size=VOCAB))
    used = packed.stats.physical_tokens
    pad = slice(used, 40)
    assert (packed.tokens[0, pad] == 0).all() and (packed.segment_ids[0, pad] == -1).all()
    assert (packed.predecessor[0, pad] == -1).all() and not packed.assistant_mask[0, pad].any()
    assert packed.logprobs[0, pad].isnan().all() and (packed.weights[0, pad] == 0).all()
    mask = tree_attention_mask(packed.subtree_end[0])
    assert torch.equal(mask[pad, pad], torch.eye(40 - used, dtype=torch.bool))
    assert not mask[:used, pad].any() and not mask[pad, :used].any()


def test_shared_prompt_is_stored_once_per_row(single_turn_group):
    rng = np.random.default_rng(2)
    group = single_turn_group(rng, prompt_len=10, completion_lens=(3, 4, 5))
    packed = pack_groups([group], PackingConfig(seq_len=64, vocab_size=VOCAB))
    assert packed.stats.logical_tokens == 3 * 10 + 12
    assert packed.stats.physical_tokens == packed.stats.unique_tokens == 10 + 12
    assert packed.stats.rows == 1


def test_routes_follow_their_tokens(single_turn_group, multi_turn_group):
    rng = np.random.default_rng(3)
    groups = _batch(rng, single_turn_group, multi_turn_group, with_routes=True)
    packed = pack_groups(groups, PackingConfig(seq_len=20, vocab_size=VOCAB))
    assert packed.routes.routes.shape == (packed.stats.rows, 20, LAYERS, TOPK)
    for k, trajectory in enumerate(_flat(groups)):
        row, positions = packed.trajectory_positions[k]
        np.testing.assert_array_equal(
            packed.routes.routes[row, positions].numpy(), trajectory.routes
        )
        assert not packed.routes.padding_mask[row, positions].any()
    used = packed.segment_ids >= 0
    assert torch.equal(packed.routes.padding_mask, ~used)


def test_uncaptured_route_suffix_is_marked_in_the_route_padding_mask():
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, VOCAB, 6)
    routes = routes_for(tokens, 4)
    trajectory = Trajectory(tokens, np.arange(6) >= 1, routes=routes)
    packed = pack_groups(
        [TrajectoryGroup([trajectory])], PackingConfig(seq_len=8, vocab_size=VOCAB)
    )
    assert packed.routes.padding_mask[0].tolist() == [False] * 4 + [True] * 4
    np.testing.assert_array_equal(packed.routes.routes[0, :4].numpy(), routes)


def test_rows_never_overflow_and_stay_near_the_lower_bound():
    rng = np.random.default_rng(5)
    groups = []
    for _ in range(24):
        prompt = rng.integers(0, VOCAB, 40)
        members = []
        for _ in range(8):
            completion = rng.integers(0, VOCAB, rng.integers(40, 161))
            tokens = np.concatenate([prompt, completion])
            mask = np.arange(len(tokens)) >= 40
            members.append(Trajectory(tokens, mask, advantage=float(rng.normal())))
        groups.append(TrajectoryGroup(members))
    packed = pack_groups(groups, PackingConfig(seq_len=1280, vocab_size=VOCAB))
    stats = packed.stats
    assert stats.rows == packed.tokens.shape[0]
    assert stats.lower_bound_rows == math.ceil(stats.unique_tokens / 1280)
    assert stats.rows <= math.ceil(1.03 * stats.lower_bound_rows)
    assert stats.physical_tokens == int((packed.segment_ids >= 0).sum())
    assert stats.physical_tokens < stats.logical_tokens


def test_route_buffer_is_reused_across_batches(single_turn_group):
    rng = np.random.default_rng(6)
    config = PackingConfig(seq_len=32, vocab_size=VOCAB)
    first = pack_groups([single_turn_group(rng, with_routes=True)] * 2, config)
    groups = [single_turn_group(rng, with_routes=True)]
    fresh = pack_groups(groups, config)
    reused = pack_groups(groups, config, route_buffer=first.routes)
    assert reused.routes.routes.data_ptr() == first.routes.routes.data_ptr()
    assert torch.equal(reused.routes.routes, fresh.routes.routes)
    assert torch.equal(reused.routes.padding_mask, fresh.routes.padding_mask)
