"""Packing refuses malformed trajectories before doing anything, naming the trajectory (flat
index, group, position) and the field; nothing is silently broadcast."""

import numpy as np
import pytest

from art_megatron_ext.packing import (
    PackingConfig,
    PackingInputError,
    Trajectory,
    TrajectoryGroup,
    pack_groups,
)

CONFIG = PackingConfig(seq_len=16, vocab_size=50)


def _good(n=4, **changes):
    fields = dict(
        tokens=np.arange(n),
        assistant_mask=np.arange(n) >= 1,  # the first token is never trained
        logprobs=np.full(n, -0.5, np.float32),
        advantage=1.0,
        weight=1.0,
        routes=None,
    )
    fields.update(changes)
    return Trajectory(**fields)


def _pack_second_of_group_one(bad):
    groups = [TrajectoryGroup([_good()]), TrajectoryGroup([_good(), bad])]
    return pack_groups(groups, CONFIG)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (
            _good(logprobs=np.array([-0.5], np.float32)),
            r"logprobs has shape \(1,\), expected \(4,\)",
        ),
        (_good(advantage=np.array([1.0])), r"advantage has shape \(1,\), expected \(4,\)"),
        (_good(weight=np.ones(5)), r"weight has shape \(5,\), expected \(4,\)"),
        (_good(advantage=float("nan")), "advantage is not finite"),
        (_good(advantage=np.array([1, 2, np.inf, 3])), "advantage is not finite"),
        (_good(weight=float("inf")), "weight is not finite"),
        (_good(tokens=np.array([1, 2, 50, 3])), r"token id 50 outside the vocabulary \[0, 50\)"),
        (_good(tokens=np.array([1, -1, 2, 3])), "token id -1 outside"),
        (_good(tokens=np.array([1.0, 2.0, 3.0, 4.0])), "tokens must be a non-empty 1-D integer"),
        (_good(tokens=np.array([], np.int64)), "tokens must be a non-empty 1-D integer"),
        (_good(assistant_mask=np.ones(3, bool)), "assistant_mask must be bool"),
        (_good(assistant_mask=np.ones(4, np.int64)), "assistant_mask must be bool"),
        (_good(assistant_mask=np.ones(4, bool)), r"assistant_mask\[0\] is True"),
        (_good(logprobs=np.array([-1, -np.inf, -1, -1])), "logprobs must be finite"),
        (_good(routes=np.zeros((5, 2, 2), np.uint8)), r"routes shape \(5, 2, 2\)"),
    ],
)
def test_rejects_bad_field_naming_the_trajectory(bad, match):
    with pytest.raises(PackingInputError, match=r"trajectory 2 \(group 1, #1\)") as error:
        _pack_second_of_group_one(bad)
    assert error.match(match)


def test_a_trajectory_longer_than_a_row_is_an_error_naming_it():
    with pytest.raises(PackingInputError, match=r"trajectory 2 \(group 1, #1\): 17 tokens"):
        _pack_second_of_group_one(_good(n=17))


def test_scalar_advantage_and_weight_are_expanded_per_token():
    packed = pack_groups([TrajectoryGroup([_good(advantage=2.0, weight=3.0)])], CONFIG)
    assert packed.advantages[0, :4].tolist() == [2.0] * 4
    assert packed.weights[0, :4].tolist() == [0.0] + [3.0] * 3  # weight counts where trained


def test_config_rejects_a_pad_token_outside_the_vocab():
    with pytest.raises(ValueError, match="pad_token_id 50 outside"):
        PackingConfig(seq_len=8, vocab_size=50, pad_token_id=50)


def test_a_trained_first_token_is_refused_before_packing():
    """No logits predict a trajectory's first token: it used to be packed with predecessor -1
    and trained, and a trainer gathering logits at the predecessor read index -1 (the row's
    last position) without a word."""
    first_trained = _good(assistant_mask=np.array([True, False, True, True]))
    with pytest.raises(PackingInputError, match=r"trajectory 0 \(group 0, #0\)") as error:
        pack_groups([TrajectoryGroup([first_trained])], CONFIG)
    assert error.match(r"assistant_mask\[0\] is True.*predecessor would be -1")
