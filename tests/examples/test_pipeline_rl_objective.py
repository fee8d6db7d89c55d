"""The example loop's objective and batch filter (examples/pipeline_rl: `grpo.py`,
`batches.py`), on hand-made tokens: the importance weight against the behaviour policy is
truncated (TIS), the clip is anchored at the proximal policy, not at a stale behaviour policy,
the age filter acts per token, and each trajectory's positions get its group's temperature.
The loop itself (DP=2, the same objective, learning) runs in tests/cross_env/test_pipeline_loop.py.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "pipeline_rl"))

from batches import take_batch
from grpo import loss_terms, temperature_grid
from loop_config import LoopConfig
from rollouts import Group, Rollout

EPS, CAP = 0.2, 2.0


def _tokens(behaviour, advantages, weights=None):
    n = len(behaviour)
    return SimpleNamespace(
        assistant_mask=torch.ones(1, n, dtype=torch.bool),
        logprobs=torch.tensor([behaviour], dtype=torch.float32),
        advantages=torch.tensor([advantages], dtype=torch.float32),
        weights=torch.tensor([weights or [1.0] * n], dtype=torch.float32),
    )


def _grad(lp_values, packed, proximal=None):
    lp = torch.tensor([lp_values], dtype=torch.float32, requires_grad=True)
    terms = loss_terms(lp, packed, EPS, CAP, proximal=proximal)
    terms.loss_sum.backward()
    return lp.grad[0], terms


def test_the_behaviour_weight_is_truncated_at_the_cap():
    # token 0: behaviour as likely as the trainer (weight 1); token 1: the behaviour policy
    # gave it e^-3 of the trainer's probability (weight e^3 = 20, truncated to 2)
    lp = [math.log(0.5), math.log(0.5)]
    packed = _tokens([math.log(0.5), math.log(0.5) - 3.0], [1.0, 1.0])
    grad, terms = _grad(lp, packed)
    assert grad.tolist() == pytest.approx([-1.0, -CAP])
    assert int(terms.tis_truncated) == 1
    assert float(terms.weight_sum) == 2.0


def test_the_clip_is_anchored_at_the_proximal_policy_not_the_behaviour_policy():
    # A stale token: the trainer (= proximal, first step on the batch) gives it 3x the
    # behaviour probability. PPO clipped at the behaviour policy would give it no gradient
    # (ratio 3 > 1 + eps, A > 0); here it trains, weighted by the truncated weight.
    lp = [math.log(0.6)]
    packed = _tokens([math.log(0.2)], [1.0])
    grad, _ = _grad(lp, packed)
    assert grad.tolist() == pytest.approx([-CAP])
    # A later minibatch step on the same batch: the trainer moved past 1 + eps from the
    # proximal policy: clipped, no gradient.
    grad, _ = _grad(lp, packed, proximal=torch.tensor([[math.log(0.6 / 1.3)]]))
    assert grad.tolist() == [0.0]
    # ... and within 1 + eps of it: the gradient is the ratio's, times the weight
    prox = math.log(0.6 / 1.1)
    grad, _ = _grad(lp, packed, proximal=torch.tensor([[prox]]))
    assert grad.tolist() == pytest.approx([-min(math.exp(prox - math.log(0.2)), CAP) * 1.1])


def test_untrained_tokens_and_weights():
    packed = _tokens([-1.0, -1.0, -1.0], [1.0, -1.0, 1.0], weights=[2.0, 1.0, 1.0])
    packed.assistant_mask[0, 2] = False  # e.g. too stale to train
    grad, terms = _grad([-1.0, -1.0, -1.0], packed)
    assert grad.tolist() == pytest.approx([-2.0, 1.0, 0.0])
    assert float(terms.weight_sum) == 3.0


def test_each_trajectory_gets_its_groups_temperature():
    packed = SimpleNamespace(
        tokens=torch.zeros(2, 6, dtype=torch.long),
        trajectory_positions=[(0, np.array([0, 1, 2])), (0, np.array([0, 1, 3])), (1, [0, 1])],
    )
    grid = temperature_grid(packed, [0.7, 0.7, 1.3])
    assert grid[0].tolist() == pytest.approx([0.7, 0.7, 0.7, 0.7, 1.0, 1.0])
    assert grid[1].tolist() == pytest.approx([1.3, 1.3, 1.0, 1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="2 temperatures for 3 trajectories"):
        temperature_grid(packed, [0.7, 0.7])


class _Queue:
    def __init__(self, groups):
        self.groups = list(groups)

    def get(self, timeout_s):
        return self.groups.pop(0)


def _rollout(versions, reward):
    spans, start = [], 0
    for version, n in versions:
        spans.append({"start": start, "end": start + n, "slot": "policy", "version": version})
        start += n
    return Rollout([5] * start, [-1.0] * start, spans, reward)


def test_the_age_filter_acts_per_token():
    cfg = LoopConfig(run_dir="/nonexistent", hf_model="m", init_adapter="a", max_policy_age=2)
    # at version 10: tokens of version 7 are 3 steps old (too old), of version 9 one step
    mixed = _rollout([(7, 4), (9, 4)], reward=1.0)
    fresh = _rollout([(10, 8)], reward=0.0)
    stale = _rollout([(7, 8)], reward=0.5)  # no token young enough: dropped
    group = Group([1, 2], [mixed, fresh, stale], started=0.0, finished=1.0, temperature=0.7)
    accepted, drops = take_batch(_Queue([group]), None, cfg, current=10, target=1)
    (got,) = accepted
    assert got.temperature == 0.7
    assert [m.trained.tolist() for m in got.members] == [[False] * 4 + [True] * 4, [True] * 8]
    assert [m.ages.tolist() for m in got.members] == [[3] * 4 + [1] * 4, [0] * 8]
    assert [m.advantage > 0 for m in got.members] == [True, False]  # relative to the kept two
    assert drops["stale"] == 1 and drops["stale_tokens"] == 4 + 8


def test_streamed_transports_pick_their_engine_for_full_weights_and_adapters():
    base = {"run_dir": "/nonexistent", "hf_model": "m", "init_adapter": "a", "update": "full"}
    gloo, nixl = LoopConfig(**base, transport="gloo"), LoopConfig(**base, transport="nixl")
    assert (gloo.streamed, gloo.transfer_backend) == (True, "art_gloo")
    assert (nixl.streamed, nixl.transfer_backend) == (True, "art_nixl")
    assert not LoopConfig(**base).streamed  # files
    lora = LoopConfig(**{**base, "update": "lora"}, transport="nixl")
    assert lora.streamed and not lora.full
    with pytest.raises(ValueError, match=r"--push sends .* --transport nixl streams"):
        LoopConfig(**{**base, "update": "lora"}, transport="nixl", push=True)
    with pytest.raises(ValueError, match=r"transport must be one of .*'nixl'.*got 'nccl'"):
        LoopConfig(**base, transport="nccl")
