"""Optimizer and trainable (LoRA) state kept resident across training jobs in one process.

Why: a Pipeline RL trainer runs many short jobs back to back. Rebuilding the optimizer and
reloading its moments and the adapter from disk for every job costs seconds per job, but
reusing them is only correct while the job continues the same optimisation: same training
session, same objective, same optimizer path. Any difference (an SFT job after RL jobs, a
different optimizer path) must start from that path's checkpoint or from fresh state, so RL
moments never leak into SFT.

Works with any `torch.nn.Module` and any optimizer with `state_dict`/`load_state_dict`,
including Megatron's `DistributedOptimizer` (its sharded main parameters and moments are
saved too, see `optimizer_state.py`); the trainable state is every parameter with
`requires_grad`. The store checkpoints through a `Checkpointer` of the layout chosen at
construction (`CheckpointLayout`); saves may run in the background (`save_async`,
`saver(async_save=True)`).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from art_megatron_ext.optim.checkpointer import Checkpointer
from art_megatron_ext.optim.collective import RankGroup
from art_megatron_ext.optim.fileio import CheckpointIO
from art_megatron_ext.optim.layouts import checkpointer_factory
from art_megatron_ext.optim.manifest import CheckpointLayout, Manifest
from art_megatron_ext.optim.schedule import PeriodicSaver, SaveSchedule
from art_megatron_ext.optim.training_state import (
    ObjectiveMismatchError,
    Params,
    TrainableStateError,
    job_state,
)

__all__ = [
    "CheckpointLayout",
    "ObjectiveMismatchError",
    "Residency",
    "ResidentKey",
    "ResidentOptimizerStore",
    "ResidentState",
    "TrainableStateError",
]

logger = logging.getLogger(__name__)

BuildOptimizer = Callable[[list[nn.Parameter]], Any]


@dataclass(frozen=True)
class ResidentKey:
    """What must match for optimizer state to be reused as is.

    Attributes:
        training_session: identifies one continuing optimisation (e.g. a run id).
        objective: the loss family, e.g. "rl" or "sft"; moments are never shared across it.
        optimizer_path: the checkpoint directory of this optimizer state.
    """

    training_session: str
    objective: str
    optimizer_path: Path

    def __post_init__(self) -> None:
        for name in ("training_session", "objective"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"ResidentKey.{name} must be a non-empty string, got {value!r}")
        object.__setattr__(self, "optimizer_path", Path(self.optimizer_path).absolute())

    def difference(self, other: ResidentKey) -> str:
        changed = [
            f"{name} {getattr(other, name)!s} -> {getattr(self, name)!s}"
            for name in ("training_session", "objective", "optimizer_path")
            if getattr(self, name) != getattr(other, name)
        ]
        return ", ".join(changed)


class Residency(enum.Enum):
    """How a job's state was obtained."""

    REUSED = "reused"  # kept in memory from the previous job, no disk access
    LOADED = "loaded"  # read from the checkpoint at the optimizer path
    REBUILT = "rebuilt"  # fresh optimizer: no checkpoint at the optimizer path


@dataclass
class ResidentState:
    """The state a job trains with; `save`/`saver` checkpoint it to `key.optimizer_path`."""

    key: ResidentKey
    model: nn.Module
    optimizer: Any
    residency: Residency
    reason: str
    step: int
    checkpointer: Checkpointer  # of `key.optimizer_path`, in the store's layout
    _params: Params = field(repr=False)
    # Set when a job using this state ended with an exception: its in-memory parameters and
    # moments may be half-updated, so the next job reloads the last committed checkpoint.
    failed: str | None = None

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in self._params}

    def state_dict(self) -> dict[str, Any]:
        """Trainable tensors and the optimizer's complete state (live tensors, not copies)."""
        return job_state(self.optimizer, self._params)

    def save(self, step: int) -> Manifest:
        """Commit this rank's trainable and optimizer state as checkpoint step `step`
        (collective; waits for a background save first)."""
        manifest = self.checkpointer.save(*self._payload(), step=step, objective=self.key.objective)
        self.step = step
        return manifest

    def save_async(self, step: int) -> Future[Manifest]:
        """Snapshot the state now and commit it as step `step` in the background.

        Returns once the snapshot is taken (the loop may then step the optimizer). Waits for
        the previous background save first and raises its error if it failed.
        """
        future = self.checkpointer.save_async(
            *self._payload(), step=step, objective=self.key.objective
        )
        self.step = step
        return future

    def wait_for_saves(self) -> Manifest | None:
        """Wait for a background save's commit (raises its error); None when none is queued."""
        return self.checkpointer.wait()

    def saver(
        self, schedule: SaveSchedule | None = None, *, async_save: bool = False
    ) -> PeriodicSaver:
        """A `PeriodicSaver` that continues from this state's step.

        With `async_save`, saves run in the background and a clean stop waits for the last
        commit. Leaving its `with` block with an exception marks this state failed (not
        reusable).
        """
        return PeriodicSaver(
            self.save_async if async_save else self.save,
            schedule,
            last_saved_step=self.step,
            on_abort=self.mark_failed,
            drain=self.wait_for_saves if async_save else None,
        )

    def mark_failed(self, exc: BaseException) -> None:
        """Stop trusting the in-memory state; the next `acquire` loads the checkpoint."""
        self.failed = f"{type(exc).__name__}: {exc}"

    def _payload(self) -> tuple[Any, ...]:
        return self.checkpointer.payload_for(self.model, self.optimizer, self._params)


def _trainable(model: nn.Module) -> Params:
    return tuple((n, p) for n, p in model.named_parameters() if p.requires_grad)


def _same_params(
    a: Iterable[tuple[str, nn.Parameter]], b: Iterable[tuple[str, nn.Parameter]]
) -> bool:
    return [(n, id(p)) for n, p in a] == [(n, id(p)) for n, p in b]


class ResidentOptimizerStore:
    """Holds at most one resident `ResidentState` per process (per rank).

    `acquire` at the start of each job returns the resident state when the key, the model
    object and its trainable parameters all match (no disk access); otherwise it loads the
    optimizer path's checkpoint, or builds a fresh optimizer when there is none, and the
    previous state is dropped.
    """

    def __init__(
        self,
        *,
        group: Any = None,
        io: CheckpointIO | None = None,
        weights_only: bool = True,
        layout: CheckpointLayout = CheckpointLayout.PER_RANK,
    ) -> None:
        """`weights_only=False` admits optimizers whose state_dict holds arbitrary objects.

        `layout` is chosen here, once: DIST checkpoints with Megatron's `dist_checkpointing`
        (model: a Megatron module or DDP around one; optimizer: DistributedOptimizer)."""
        self._open_checkpointer = checkpointer_factory(
            layout, group=group, io=io, weights_only=weights_only
        )
        self._ranks = RankGroup(group)
        self._resident: ResidentState | None = None

    @property
    def resident(self) -> ResidentState | None:
        return self._resident

    def release(self) -> None:
        """Drop the resident state (frees optimizer memory once callers drop theirs)."""
        self._resident = None

    def acquire(
        self,
        key: ResidentKey,
        model: nn.Module,
        build_optimizer: BuildOptimizer,
        *,
        reset_trainable: Callable[[nn.Module], None] | None = None,
    ) -> ResidentState:
        """The state for a job with `key` training `model`.

        Args:
            key: the job's residency key.
            model: the module whose `requires_grad` parameters are the trainable state.
            build_optimizer: builds an optimizer over a list of parameters.
            reset_trainable: called on the model when state is rebuilt (no checkpoint), so the
                job starts from the adapter it wants rather than the previous job's weights.

        Raises:
            ObjectiveMismatchError, TrainableStateError, checkpoint errors: raised before
            anything changes; the previous resident state (if any) stays in effect. An error
            from `build_optimizer` or loading into the new optimizer leaves nothing resident
            (the previous state was already dropped to free its memory).
        """
        params = _trainable(model)
        if not params:
            raise ValueError(f"{type(model).__name__} has no parameters with requires_grad")
        current = self._resident
        reusable = (
            current is not None
            and current.failed is None
            and current.key == key
            and current.model is model
            and _same_params(current._params, params)
        )
        # Ranks must agree: a rank that reloads enters a collective load the others skip.
        if not all(self._ranks.all_gather(reusable)):
            if reusable:
                reusable, reason = False, "another rank cannot reuse its state"
            else:
                reason = self._why_not_reused(current, key, model)
        if reusable:
            assert current is not None
            current.residency, current.reason = Residency.REUSED, "key matches"
            return current

        if current is not None:
            # A background save must commit before its directory is read or dropped.
            current.wait_for_saves()
        checkpointer = self._open_checkpointer(key.optimizer_path)
        restore = checkpointer.restore_for(key.objective, params)  # raises before any change
        # Everything that can be checked was checked: drop the previous state before building
        # the new optimizer, so two optimizers' moments never coexist in device memory.
        self._resident = None
        if restore is None:
            if reset_trainable is not None:
                reset_trainable(model)
            optimizer = build_optimizer([p for _, p in params])
            residency, step = Residency.REBUILT, 0
        else:
            optimizer = build_optimizer([p for _, p in params])
            restore.apply(model, optimizer, params)
            residency, step = Residency.LOADED, restore.step
        state = ResidentState(
            key=key,
            model=model,
            optimizer=optimizer,
            residency=residency,
            reason=reason,
            step=step,
            checkpointer=checkpointer,
            _params=params,
        )
        logger.info("optimizer state %s for %s (%s)", residency.value, key, reason)
        self._resident = state
        return state

    @staticmethod
    def _why_not_reused(current: ResidentState | None, key: ResidentKey, model: nn.Module) -> str:
        if current is None:
            return "nothing resident"
        if current.key != key:
            return key.difference(current.key)
        if current.failed is not None:
            return f"the previous job failed after step {current.step} ({current.failed})"
        if current.model is not model:
            return "another model object"
        return "the model's trainable parameters changed"
