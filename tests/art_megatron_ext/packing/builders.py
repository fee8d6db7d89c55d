"""Builders of small trajectory groups shaped like real batches, shared by the packing tests
(imported relatively: `from .builders import ...`; conftest.py offers them as fixtures)."""

import numpy as np

from art_megatron_ext.packing import Trajectory, TrajectoryGroup

VOCAB = 50
LAYERS, TOPK = 2, 2


def routes_for(tokens, count=None):
    """Routes that depend only on the prefix, as a real forward's do: sharers of a prefix
    recorded the same routes for it."""
    count = len(tokens) if count is None else count
    prefix_code = np.cumsum(np.asarray(tokens, np.int64) * 31 + 7)[:count]
    grid = prefix_code[:, None, None] + np.arange(LAYERS)[:, None] * 3 + np.arange(TOPK)
    return (grid % 6 + 2).astype(np.uint8)


def _rollout(rng, prompt, completion_len, advantage, with_routes, route_tokens=None):
    completion = rng.integers(0, VOCAB, completion_len)
    tokens = np.concatenate([prompt, completion])
    mask = np.zeros(len(tokens), bool)
    mask[len(prompt) :] = True
    logprobs = np.full(len(tokens), np.nan, np.float32)
    logprobs[len(prompt) :] = -rng.random(completion_len, dtype=np.float32)
    routes = None
    if with_routes:
        routes = routes_for(tokens, route_tokens)
    return Trajectory(tokens, mask, logprobs, advantage=advantage, weight=1.0, routes=routes)


def make_single_turn_group(rng, prompt_len=6, completion_lens=(3, 5, 4), with_routes=False):
    """Rollouts of one prompt, each with its own advantage."""
    prompt = rng.integers(0, VOCAB, prompt_len)
    return TrajectoryGroup(
        [_rollout(rng, prompt, n, float(rng.normal()), with_routes) for n in completion_lens]
    )


def make_multi_turn_group(rng, turns=3, with_routes=False):
    """History k = prompt + k (assistant, user) turns + assistant k; only the last assistant
    turn is trained, earlier ones are context."""
    pieces = [rng.integers(0, VOCAB, 4)]
    for _ in range(turns):
        pieces += [rng.integers(0, VOCAB, rng.integers(2, 5)), rng.integers(0, VOCAB, 2)]
    members = []
    shared_logprobs = [-rng.random(len(p), dtype=np.float32) for p in pieces]
    for k in range(turns):
        used = pieces[: 2 * k + 2]
        tokens = np.concatenate(used)
        mask = np.zeros(len(tokens), bool)
        mask[len(tokens) - len(used[-1]) :] = True
        logprobs = np.concatenate(shared_logprobs[: 2 * k + 2])
        logprobs[~mask] = np.nan
        routes = routes_for(tokens) if with_routes else None
        members.append(Trajectory(tokens, mask, logprobs, advantage=0.5, routes=routes))
    return TrajectoryGroup(members)
