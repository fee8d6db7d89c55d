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
`requires_grad`. Saves may run in the background (`save_async`, `saver(async_save=True)`).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from art_megatron_ext.optim.async_save import AsyncCheckpointer
from art_megatron_ext.optim.checkpoint import CheckpointConfig, LoadedShard, ShardedCheckpointer
from art_megatron_ext.optim.collective import RankGroup
from art_megatron_ext.optim.dist_checkpoint import DistCheckpointer, DistManifest
from art_megatron_ext.optim.fileio import CheckpointIO
from art_megatron_ext.optim.manifest import Manifest
from art_megatron_ext.optim.optimizer_state import (
    OptimizerLayoutError,
    capture_optimizer_state,
    restore_optimizer_state,
)
from art_megatron_ext.optim.schedule import PeriodicSaver, SaveSchedule

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


class ObjectiveMismatchError(RuntimeError):
    """The checkpoint at the optimizer path was written for another objective."""


class TrainableStateError(RuntimeError):
    """A checkpoint's trainable tensors do not match the model's trainable parameters."""


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


class CheckpointLayout(enum.Enum):
    """Where the store checkpoints (docs/checkpoint-format.md).

    PER_RANK: one file per rank (`ShardedCheckpointer`); any optimizer; async saves; loads only
    at the saving layout. DIST: Megatron `dist_checkpointing` (`DistCheckpointer`); Megatron's
    DistributedOptimizer only; async saves; loads at any TP/DP layout.
    """

    PER_RANK = "per-rank"
    DIST = "dist_checkpointing"


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
    checkpointer: ShardedCheckpointer
    _params: tuple[tuple[str, nn.Parameter], ...] = field(repr=False)
    # Set when a job using this state ended with an exception: its in-memory parameters and
    # moments may be half-updated, so the next job reloads the last committed checkpoint.
    failed: str | None = None

    _async: AsyncCheckpointer | None = field(default=None, repr=False)
    dist_checkpointer: DistCheckpointer | None = field(default=None, repr=False)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in self._params}

    def state_dict(self) -> dict[str, Any]:
        """Trainable tensors and the optimizer's complete state (live tensors, not copies)."""
        return {
            "trainable": self.trainable_state(),
            "optimizer": capture_optimizer_state(self.optimizer, self._params),
        }

    def save(self, step: int) -> Manifest | DistManifest:
        """Commit this rank's trainable and optimizer state as checkpoint step `step`."""
        self.wait_for_saves()
        if self.dist_checkpointer is not None:
            dist_manifest = self.dist_checkpointer.save(
                _megatron_module(self.model),
                self.optimizer,
                step=step,
                objective=self.key.objective,
            )
            self.step = step
            return dist_manifest
        manifest = self.checkpointer.save(
            self.state_dict(), step=step, objective=self.key.objective
        )
        self.step = step
        return manifest

    def save_async(self, step: int) -> None:
        """Snapshot the state now and commit it as step `step` in the background.

        Returns once the snapshot is taken (the loop may then step the optimizer). Waits for
        the previous background save first and raises its error if it failed.
        """
        if self.dist_checkpointer is not None:
            self.dist_checkpointer.save_async(
                _megatron_module(self.model),
                self.optimizer,
                step=step,
                objective=self.key.objective,
            )
            self.step = step
            return
        if self._async is None:
            self._async = AsyncCheckpointer(self.checkpointer)
        self._async.save(self.state_dict(), step=step, objective=self.key.objective)
        self.step = step

    def wait_for_saves(self) -> Manifest | DistManifest | None:
        """Wait for a background save's commit (raises its error); None when none is queued."""
        if self.dist_checkpointer is not None:
            return self.dist_checkpointer.wait()
        return None if self._async is None else self._async.wait()

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


def _megatron_module(model: nn.Module) -> nn.Module:
    """The Megatron module inside a DDP wrapper (its `sharded_state_dict` names the LoRA)."""
    return getattr(model, "module", model)


def _trainable(model: nn.Module) -> tuple[tuple[str, nn.Parameter], ...]:
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

        `layout=CheckpointLayout.DIST` checkpoints with Megatron's `dist_checkpointing`
        (model: a Megatron module or DDP around one; optimizer: DistributedOptimizer)."""
        if not isinstance(layout, CheckpointLayout):
            raise TypeError(f"layout must be a CheckpointLayout, got {layout!r}")
        if layout is CheckpointLayout.DIST and group is not None:
            raise ValueError("the dist_checkpointing layout runs on the default process group")
        self._layout = layout
        self._group = group
        self._ranks = RankGroup(group)
        self._io = io
        self._weights_only = weights_only
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
            from `build_optimizer` or the optimizer's `load_state_dict` leaves nothing
            resident (the previous state was already dropped to free its memory).
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
        checkpointer = ShardedCheckpointer(
            CheckpointConfig(key.optimizer_path, weights_only=self._weights_only),
            group=self._group,
            io=self._io,
        )
        dist_ck = None
        if self._layout is CheckpointLayout.DIST:
            dist_ck = DistCheckpointer(key.optimizer_path, io=self._io)
            optimizer, residency, step = self._restore_dist(
                key, model, params, build_optimizer, reset_trainable, dist_ck
            )
        else:
            optimizer, residency, step = self._restore_per_rank(
                key, model, params, build_optimizer, reset_trainable, checkpointer
            )
        state = ResidentState(
            key=key,
            model=model,
            optimizer=optimizer,
            residency=residency,
            reason=reason,
            step=step,
            checkpointer=checkpointer,
            _params=params,
            dist_checkpointer=dist_ck,
        )
        logger.info("optimizer state %s for %s (%s)", residency.value, key, reason)
        self._resident = state
        return state

    def _restore_per_rank(
        self,
        key: ResidentKey,
        model: nn.Module,
        params: tuple[tuple[str, nn.Parameter], ...],
        build_optimizer: BuildOptimizer,
        reset_trainable: Callable[[nn.Module], None] | None,
        checkpointer: ShardedCheckpointer,
    ) -> tuple[Any, Residency, int]:
        """(optimizer, residency, step) from the per-rank layout, or rebuilt without one."""
        loaded = checkpointer.load()
        restored, local_error = None, None
        try:
            restored = None if loaded is None else _validated_payload(key, params, loaded)
        except (ObjectiveMismatchError, TrainableStateError, OptimizerLayoutError) as exc:
            local_error = exc
        errors = [
            e
            for e in self._ranks.all_gather(None if local_error is None else str(local_error))
            if e
        ]
        if local_error is not None:
            raise local_error
        if errors:
            raise TrainableStateError(
                f"another rank refused checkpoint {key.optimizer_path}: {errors[0]}"
            )
        # Everything that can be checked was checked: drop the previous state before building
        # the new optimizer, so two optimizers' moments never coexist in device memory.
        self._resident = None
        if restored is None:
            if reset_trainable is not None:
                reset_trainable(model)
            return build_optimizer([p for _, p in params]), Residency.REBUILT, 0
        trainable, optim_state = restored
        optimizer = build_optimizer([p for _, p in params])
        assert loaded is not None
        # Optimizer first: a layout mismatch raises before the model is touched. (For fp32
        # parameters a distributed optimizer's main shard is a view of the parameter; the
        # copy below writes the same values again.)
        restore_optimizer_state(optimizer, optim_state, params, source=str(loaded.path))
        if trainable is not None:
            with torch.no_grad():
                for name, p in params:
                    p.copy_(trainable[name])
        return optimizer, Residency.LOADED, loaded.step or 0

    def _restore_dist(
        self,
        key: ResidentKey,
        model: nn.Module,
        params: tuple[tuple[str, nn.Parameter], ...],
        build_optimizer: BuildOptimizer,
        reset_trainable: Callable[[nn.Module], None] | None,
        dist_ck: DistCheckpointer,
    ) -> tuple[Any, Residency, int]:
        """(optimizer, residency, step) from the dist_checkpointing layout, or rebuilt."""
        manifest = dist_ck.committed()
        if manifest is not None and manifest.objective != key.objective:
            raise _objective_mismatch(key.optimizer_path, manifest.objective, key.objective)
        self._resident = None
        if manifest is None:
            if reset_trainable is not None:
                reset_trainable(model)
            return build_optimizer([p for _, p in params]), Residency.REBUILT, 0
        optimizer = build_optimizer([p for _, p in params])
        loaded = dist_ck.load(_megatron_module(model), optimizer)
        assert loaded is not None
        return optimizer, Residency.LOADED, loaded.step

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


def _objective_mismatch(path: Any, found: str | None, expected: str) -> ObjectiveMismatchError:
    return ObjectiveMismatchError(
        f"checkpoint {path} holds {found!r} optimizer state but the job's objective is "
        f"{expected!r}; refusing to mix their moments. Use a separate optimizer_path per "
        "objective. Nothing was loaded; the previous state stays."
    )


def _validated_payload(
    key: ResidentKey, params: tuple[tuple[str, nn.Parameter], ...], loaded: LoadedShard
) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any]]:
    """(trainable tensors or None for legacy, optimizer state_dict), checked against the job."""
    if loaded.objective is not None and loaded.objective != key.objective:
        raise _objective_mismatch(loaded.path, loaded.objective, key.objective)
    payload = loaded.state
    if isinstance(payload, dict) and "optimizer" in payload:
        trainable, optim_state = payload.get("trainable"), payload["optimizer"]
    else:  # legacy shards held only the optimizer's state_dict
        trainable, optim_state = None, payload
    if trainable is not None:
        _check_trainable(loaded.path, params, trainable)
    return trainable, optim_state


def _check_trainable(
    path: Path, params: tuple[tuple[str, nn.Parameter], ...], trainable: dict[str, torch.Tensor]
) -> None:
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
