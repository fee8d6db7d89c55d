"""A job's trainable and optimizer state as the per-rank layout stores it, and the checks a
checkpoint must pass before the resident store uses it.

Why: restoring must refuse a checkpoint that belongs to another optimisation (another
objective: RL moments must never leak into SFT) or to other parameters (another adapter
shape) before anything changes, with an error that says what differs. The per-rank payload
is `{"trainable": {name: tensor}, "optimizer": <capture_optimizer_state>}`
(docs/checkpoint-format.md, "Shard content"); older shards held only an optimizer
`state_dict`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from art_megatron_ext.optim.optimizer_state import capture_optimizer_state, restore_optimizer_state

__all__ = [
    "ObjectiveMismatchError",
    "Params",
    "TrainableStateError",
    "apply_job_state",
    "check_objective",
    "job_state",
    "validated_job_state",
]

#: A job's trainable parameters by name, in the model's order.
Params = tuple[tuple[str, nn.Parameter], ...]


class ObjectiveMismatchError(RuntimeError):
    """The checkpoint at the optimizer path was written for another objective."""


class TrainableStateError(RuntimeError):
    """A checkpoint's trainable tensors do not match the model's trainable parameters."""


def job_state(optimizer: Any, params: Params) -> dict[str, Any]:
    """Trainable tensors and the optimizer's complete state (live tensors, not copies)."""
    return {
        "trainable": {name: p.detach() for name, p in params},
        "optimizer": capture_optimizer_state(optimizer, params),
    }


def check_objective(path: Any, found: str | None, expected: str) -> None:
    if found is not None and found != expected:
        raise ObjectiveMismatchError(
            f"checkpoint {path} holds {found!r} optimizer state but the job's objective is "
            f"{expected!r}; refusing to mix their moments. Use a separate optimizer_path per "
            "objective. Nothing was loaded; the previous state stays."
        )


def validated_job_state(
    path: Path, objective: str | None, expected: str, params: Params, state: Any
) -> tuple[dict[str, torch.Tensor] | None, Any]:
    """(trainable tensors or None for a legacy shard, optimizer state) of a loaded per-rank
    shard, checked against the job's objective and trainable parameters."""
    check_objective(path, objective, expected)
    if isinstance(state, dict) and "optimizer" in state:
        trainable, optim_state = state.get("trainable"), state["optimizer"]
    else:  # legacy shards held only the optimizer's state_dict
        trainable, optim_state = None, state
    if trainable is not None:
        _check_trainable(path, params, trainable)
    return trainable, optim_state


def apply_job_state(
    optimizer: Any,
    params: Params,
    trainable: dict[str, torch.Tensor] | None,
    optim_state: Any,
    source: str,
) -> None:
    """Load a validated job state into a freshly built `optimizer` and the parameters.

    Optimizer first: a layout mismatch raises before the model is touched. (For fp32
    parameters a distributed optimizer's main shard is a view of the parameter; the copy
    below writes the same values again.)
    """
    restore_optimizer_state(optimizer, optim_state, params, source=source)
    if trainable is not None:
        with torch.no_grad():
            for name, p in params:
                p.copy_(trainable[name])


def _check_trainable(path: Path, params: Params, trainable: dict[str, torch.Tensor]) -> None:
    want = {n: tuple(p.shape) for n, p in params}
    have = {n: tuple(t.shape) for n, t in trainable.items()}
    if want != have:
        missing = sorted(set(want) - set(have))
        extra = sorted(set(have) - set(want))
        reshaped = sorted(n for n in set(want) & set(have) if want[n] != have[n])
        raise TrainableStateError(
            f"checkpoint {path} does not match the model's trainable parameters (missing "
            f"{missing}, unexpected {extra}, other shape {reshaped}). Nothing was loaded; the "
            "previous state stays."
        )
