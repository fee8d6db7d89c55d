"""What packing takes in: trajectories grouped as they came from rollouts, and their checks.

Why a separate module: every per-token array is validated once, here, against its own
trajectory's length, before any prefix sharing or placement looks at it. numpy would happily
broadcast a one-element `logprobs` array over a 4k-token trajectory; we refuse it instead, and
every message names the trajectory by its group and position and by its flat index (the order
used in `PackedBatch.trajectory_positions`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


class PackingInputError(ValueError):
    """A trajectory cannot be packed; the message names it and the field at fault."""


@dataclass(frozen=True)
class Trajectory:
    """One rollout (or one multi-turn history) as the trainer receives it.

    Attributes:
        tokens: `[n]` integer token ids, `n >= 1`.
        assistant_mask: `[n]` bool, True on the tokens the loss trains on. The first token
            cannot be trained (nothing before it predicts it): `assistant_mask[0]` must be
            False, so every trained token has a predecessor `>= 0` in the packed rows.
        logprobs: `[n]` float sampling logprobs, NaN where none (prompt tokens); None = all NaN.
        advantage: a finite scalar, or `[n]` finite per-token advantages.
        weight: a finite scalar, or `[n]` finite per-token loss weights.
        routes: `[n_r, layers, topk]` routed experts for the first `n_r <= n` tokens, or None.
    """

    tokens: np.ndarray
    assistant_mask: np.ndarray
    logprobs: np.ndarray | None = None
    advantage: float | np.ndarray = 0.0
    weight: float | np.ndarray = 1.0
    routes: np.ndarray | None = None


@dataclass(frozen=True)
class TrajectoryGroup:
    """Trajectories that may share prefixes (rollouts of one prompt, turns of one chat).
    Sharing is only looked for inside a group."""

    trajectories: Sequence[Trajectory]


@dataclass(frozen=True)
class CheckedTrajectory:
    """A validated trajectory with every per-token field materialized at its length."""

    index: int  # flat index over all groups
    group: int
    tokens: np.ndarray  # int64 [n]
    assistant_mask: np.ndarray  # bool [n]
    logprobs: np.ndarray  # float32 [n], NaN where none
    advantages: np.ndarray  # float32 [n]
    weights: np.ndarray  # float32 [n]
    routes: np.ndarray | None
    name: str = field(repr=False, default="")

    @property
    def length(self) -> int:
        return len(self.tokens)


def _per_token(value, length: int, what: str, name: str, dtype) -> np.ndarray:
    """A scalar becomes `[length]`; an array must already be `[length]`, never broadcast."""
    array = np.asarray(value)
    if array.ndim == 0:
        return np.full(length, array, dtype=dtype)
    if array.ndim != 1 or array.shape[0] != length:
        raise PackingInputError(
            f"{name}: {what} has shape {array.shape}, expected ({length},) like its tokens"
        )
    return array.astype(dtype, copy=False)


def check_trajectory(
    trajectory: Trajectory, *, index: int, group: int, position: int, vocab_size: int
) -> CheckedTrajectory:
    """Validate one trajectory; raises PackingInputError naming it."""
    name = f"trajectory {index} (group {group}, #{position})"
    tokens = np.asarray(trajectory.tokens)
    if tokens.ndim != 1 or tokens.shape[0] == 0 or tokens.dtype.kind not in "iu":
        raise PackingInputError(
            f"{name}: tokens must be a non-empty 1-D integer array, got {tokens.dtype} "
            f"{tokens.shape}"
        )
    length = tokens.shape[0]
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise PackingInputError(f"{name}: token id {bad} outside the vocabulary [0, {vocab_size})")
    mask = np.asarray(trajectory.assistant_mask)
    if mask.dtype != np.bool_ or mask.shape != (length,):
        raise PackingInputError(
            f"{name}: assistant_mask must be bool ({length},), got {mask.dtype} {mask.shape}"
        )
    if mask[0]:
        raise PackingInputError(
            f"{name}: assistant_mask[0] is True, but no logits predict a trajectory's first "
            "token (its predecessor would be -1); start the trajectory with at least one "
            "untrained (prompt or BOS) token"
        )
    if trajectory.logprobs is None:
        logprobs = np.full(length, np.nan, dtype=np.float32)
    else:
        logprobs = np.asarray(trajectory.logprobs)
        if logprobs.ndim != 1 or logprobs.shape[0] != length:
            raise PackingInputError(
                f"{name}: logprobs has shape {logprobs.shape}, expected ({length},)"
            )
        logprobs = logprobs.astype(np.float32, copy=False)
        if np.isinf(logprobs).any():
            raise PackingInputError(f"{name}: logprobs must be finite (NaN where none)")
    advantages = _per_token(trajectory.advantage, length, "advantage", name, np.float32)
    if not np.isfinite(advantages).all():
        raise PackingInputError(f"{name}: advantage is not finite")
    weights = _per_token(trajectory.weight, length, "weight", name, np.float32)
    if not np.isfinite(weights).all():
        raise PackingInputError(f"{name}: weight is not finite")
    routes = trajectory.routes
    if routes is not None:
        routes = np.asarray(routes)
        if routes.ndim != 3 or routes.shape[0] > length:
            raise PackingInputError(
                f"{name}: routes shape {routes.shape} is not [tokens <= {length}, layers, topk]"
            )
    return CheckedTrajectory(
        index=index,
        group=group,
        tokens=tokens.astype(np.int64, copy=False),
        assistant_mask=mask,
        logprobs=logprobs,
        advantages=advantages,
        weights=weights,
        routes=routes,
        name=name,
    )


def check_groups(
    groups: Sequence[TrajectoryGroup], vocab_size: int
) -> list[list[CheckedTrajectory]]:
    """Validate every trajectory of every group, numbering them in flat order."""
    checked: list[list[CheckedTrajectory]] = []
    index = 0
    for group_index, group in enumerate(groups):
        members = []
        for position, trajectory in enumerate(group.trajectories):
            members.append(
                check_trajectory(
                    trajectory,
                    index=index,
                    group=group_index,
                    position=position,
                    vocab_size=vocab_size,
                )
            )
            index += 1
        checked.append(members)
    return checked
