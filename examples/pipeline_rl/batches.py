"""A step's batch: taken off the rollout queue on rank 0, shared out to the data-parallel ranks.

The age filter works per token: a token whose policy age (the trainer's version minus the
version in its span) exceeds `max_policy_age` is not trained (its `assistant_mask` is off; it
stays in the context of the tokens after it), the rest of its trajectory is. A trajectory with
no token young enough is dropped, and a group needs two trajectories left (GRPO's advantage is
relative to the group) and some reward variance.

Rank 0 alone runs the rollout workers and takes groups off the queue until the target is
accepted; `share` broadcasts the accepted groups as plain records and each rank trains on
every `world`-th one (rank r: groups r, r + world, ...), so each rank packs its own rows and
the data-parallel gradient is over the whole batch. `pack_for_step` packs them on the host (the
packer is numpy) and moves every tensor of the rows, and the temperature grid, to the rank's
device in one copy each.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from grpo import temperature_grid
from loop_config import LoopConfig
from stats import token_ages
from task import group_advantages


@dataclass
class Member:
    """One trajectory of an accepted group, as every rank needs it."""

    completion: list[int]
    logprobs: list[float]  # behaviour logprobs (the server's, at the group's temperature)
    ages: np.ndarray  # policy age per completion token
    trained: np.ndarray  # bool per completion token: young enough to train on
    reward: float
    advantage: float
    spans: list[dict]


@dataclass
class AcceptedGroup:
    prompt: list[int]
    temperature: float
    members: list[Member]
    rollout_s: float  # from the group's request to its response (the autotuner reads it)
    put_wait_s: float  # how long its worker waited for room on the queue


def take_batch(queue, workers, cfg: LoopConfig, current: int, target: int):
    """Groups off the queue until `target` are accepted (rank 0); returns them and the counts
    of what the filters dropped."""
    accepted: list[AcceptedGroup] = []
    drops = {"stale": 0, "stale_tokens": 0, "stale_groups": 0, "zero_var": 0, "offered": 0}
    starving = 0  # groups in a row with fewer than 2 trajectories within the age limit
    while len(accepted) < target:
        if starving >= 8 * target:
            raise RuntimeError(
                f"{starving} groups in a row had fewer than 2 trajectories with a token within "
                f"the policy-age limit {cfg.max_policy_age} at version {current}: the rollouts "
                f"do not get the updates (updates go to slot {cfg.publish_slot!r}, rollouts "
                f"sample {cfg.slot!r})"
            )
        try:
            group = queue.get(timeout_s=120)
        except TimeoutError:
            if workers.error is not None:
                raise RuntimeError("a rollout worker failed") from workers.error
            raise
        drops["offered"] += 1
        keep = []
        for r in group.rollouts:
            ages = token_ages(r.spans, len(r.completion), current)
            trained = ages <= cfg.max_policy_age
            drops["stale_tokens"] += int((~trained).sum())
            if trained.any():
                keep.append((r, ages, trained))
            else:
                drops["stale"] += 1
        if len(keep) < 2:
            drops["stale_groups"] += 1
            starving += 1
            continue
        starving = 0
        rewards = [r.reward for r, _, _ in keep]
        if np.std(rewards) == 0:
            drops["zero_var"] += 1
            continue
        advantages = group_advantages(rewards)
        members = [
            Member(r.completion, r.logprobs, ages, trained, r.reward, float(a), r.spans)
            for (r, ages, trained), a in zip(keep, advantages, strict=True)
        ]
        accepted.append(
            AcceptedGroup(
                group.prompt,
                group.temperature,
                members,
                group.finished - group.started,
                group.put_wait_s,
            )
        )
    return accepted, drops


def share(accepted: list[AcceptedGroup] | None, rank: int, world: int):
    """Every rank's share of rank 0's `accepted` (collective; `accepted` is read on rank 0
    only). Returns (all groups, this rank's groups). Each rank gets at least one group:
    the caller asks for at least `world`."""
    box = [accepted if rank == 0 else None]
    if world > 1:
        torch.distributed.broadcast_object_list(box, src=0)
    groups = box[0]
    if len(groups) < world:
        raise ValueError(f"{len(groups)} groups for {world} data-parallel ranks")
    return groups, groups[rank::world]


def to_packing_groups(groups: list[AcceptedGroup]):
    """The packer's groups, and each trajectory's temperature in packing order."""
    from art_megatron_ext.packing import Trajectory, TrajectoryGroup

    out, temperatures = [], []
    for group in groups:
        p = len(group.prompt)
        members = []
        for m in group.members:
            members.append(
                Trajectory(
                    tokens=np.asarray(group.prompt + m.completion, dtype=np.int64),
                    assistant_mask=np.r_[np.zeros(p, bool), m.trained],
                    logprobs=np.r_[np.full(p, np.nan), m.logprobs].astype(np.float32),
                    advantage=m.advantage,
                )
            )
            temperatures.append(group.temperature)
        out.append(TrajectoryGroup(members))
    return out, temperatures


def on_device(packed, device):
    """The `PackedBatch` with every tensor field on `device` (its host-side trajectory
    positions and stats as they are). Route tensors are not moved: the example trains no MoE."""
    if packed.routes is not None:
        raise ValueError("on_device moves no route tensors: this batch carries routes")
    moved = {
        f.name: getattr(packed, f.name).to(device)
        for f in dataclasses.fields(packed)
        if isinstance(getattr(packed, f.name), torch.Tensor)
    }
    return dataclasses.replace(packed, **moved)


def pack_for_step(groups: list[AcceptedGroup], cfg: LoopConfig, vocab_size: int, device):
    """This rank's groups as packed prefix-tree rows on `device`, and the [rows, seq] grid of
    each position's sampling temperature there too."""
    from art_megatron_ext.packing import PackingConfig, pack_groups

    packing_groups, temps = to_packing_groups(groups)
    packed = pack_groups(packing_groups, PackingConfig(seq_len=cfg.seq_len, vocab_size=vocab_size))
    return on_device(packed, device), temperature_grid(packed, temps, device)
