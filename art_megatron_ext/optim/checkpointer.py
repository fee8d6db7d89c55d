"""`Checkpointer`: one checkpoint directory in one layout, behind one interface.

Why: the per-rank layout (`ShardedCheckpointer`) and the dist_checkpointing layout
(`DistCheckpointer`) differ only in how a rank writes and reads its part of a generation.
Everything else is one protocol, implemented here once: rank 0 numbers the generation, the
ranks agree on their written files, `commit.commit` atomically replaces the manifest;
`save_async` runs the same save on the checkpoint lane's thread after a host snapshot
(`async_save.py`); saves are ordered (`save`, `save_async`, `load` and `wait` first wait
for the queued save, whose error is raised once). The resident store holds a `Checkpointer`
chosen once from the `CheckpointLayout` (`layouts.checkpointer_factory`) and only calls the
methods below: `payload_for` and `restore_for` are how a layout saves and restores a job's
model and optimizer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch.distributed as dist
from torch import nn

from art_megatron_ext.optim.async_save import Lane, checkpoint_lane
from art_megatron_ext.optim.collective import RankGroup
from art_megatron_ext.optim.commit import commit, decide_on_first, gather_or_raise
from art_megatron_ext.optim.errors import CheckpointFormatError, CheckpointSaveError
from art_megatron_ext.optim.fileio import CheckpointIO
from art_megatron_ext.optim.manifest import (
    MANIFEST_NAME,
    CheckpointLayout,
    FileRecord,
    Manifest,
)
from art_megatron_ext.optim.training_state import Params

__all__ = ["Checkpointer", "LoadedCheckpoint", "Params", "Restore", "Staged"]


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What `load` read: the committed generation (or a legacy per-rank shard set)."""

    step: int | None  # None for legacy shards, which carry no manifest
    objective: str | None
    generation: int | None
    path: Path  # per-rank: this rank's shard; dist: the generation directory
    state: Any = None  # per-rank: this rank's state; dist: loaded into the given targets
    legacy: bool = False


@dataclass(frozen=True)
class Restore:
    """A committed checkpoint read and checked for a job, not yet applied.

    The resident store drops the previous optimizer and builds the new one between
    `Checkpointer.restore_for` (which raises before anything changes) and `apply`.
    """

    step: int
    apply: Callable[[nn.Module, Any, Params], None]  # (model, optimizer, params)


@dataclass
class Staged:
    """A save between the caller's thread and the write: what to write for which step."""

    step: int
    objective: str
    data: Any  # the layout's: a state (snapshot), or a planned Megatron save or its error
    generation: int | None = None  # chosen on the caller's thread or at the write


class Checkpointer(ABC):
    """Saves and loads one checkpoint directory (collective over `group`).

    Every rank of `group` (default: the world, or a lone process when torch.distributed is
    not initialized) calls `save`, `save_async`, `load`, `wait` and `restore_for` together.
    `payload` is what the layout saves: see its `save`.
    """

    layout: ClassVar[CheckpointLayout]

    def __init__(self, directory: Path, *, group: Any = None, io: CheckpointIO | None = None):
        self.directory = Path(directory)
        self.group = RankGroup(group)
        self.io = io or CheckpointIO()
        self._last_generation: int | None = None  # None: rank 0 rereads the manifest
        self._lane: Lane | None = None
        self._pending: Future[Manifest] | None = None
        self._pending_step: int | None = None

    # ---- the interface -------------------------------------------------------------------
    def latest(self) -> Manifest | None:
        """The manifest of the committed generation, or None when there is none."""
        path = self.directory / MANIFEST_NAME
        try:
            data = self.io.read_bytes(path)
        except FileNotFoundError:
            return None
        manifest = Manifest.from_json(data, path)
        if manifest.layout is not self.layout:
            raise CheckpointFormatError(
                f"{path}: a {manifest.layout.value} checkpoint, but this checkpointer "
                f"reads and writes the {self.layout.value} layout; open it with "
                f"CheckpointLayout.{manifest.layout.name}. Nothing was read or written."
            )
        return manifest

    def save(self, *payload: Any, step: int, objective: str) -> Manifest:
        """Write `payload` as a new generation and commit it; returns its manifest.

        On failure every rank raises (the failing rank its own error, the others
        `CheckpointSaveError`) and the last committed generation stays in effect.
        """
        self._check_save(payload, step)
        self.wait()
        staged = self._stage(payload, step, objective, snapshot=False)
        return self._write_and_commit(staged, self.group)

    def save_async(self, *payload: Any, step: int, objective: str) -> Future[Manifest]:
        """Snapshot `payload` now; write and commit it on the checkpoint lane's thread.

        Waits for the previous queued save first and raises its error if it failed
        (nothing new is queued then). When this returns the caller may change its tensors:
        what is written is the state at the call. Returns the save's future (its manifest).
        """
        self._check_save(payload, step)
        self.wait()
        if self._lane is None:  # collective: every rank's first save_async
            self._lane = checkpoint_lane(self._lane_ranks())
        staged = self._stage(payload, step, objective, snapshot=True)
        self._pending = self._lane.submit(self._write_and_commit, staged, self._lane.group)
        self._pending_step = step
        return self._pending

    @property
    def _background_group(self) -> RankGroup | None:
        """The lane's group (None before the first `save_async`)."""
        return None if self._lane is None else self._lane.group

    @property
    def pending_step(self) -> int | None:
        """The step of a queued save that has not been waited for."""
        return self._pending_step

    def wait(self) -> Manifest | None:
        """Wait for the queued save's commit; its manifest, None if none was queued.
        A failed save raises here, once."""
        pending, self._pending, self._pending_step = self._pending, None, None
        if pending is None:
            return None
        return pending.result()

    def close(self) -> Manifest | None:
        """Wait for the queued save (the lane's thread stays for other checkpointers)."""
        return self.wait()

    def load(self, *targets: Any) -> LoadedCheckpoint | None:
        """Load the committed generation (see the layout's `_load`); None when there is
        none. Raises on every rank when any rank's part is missing or corrupt; nothing is
        loaded then."""
        self.wait()
        loaded = self._load(*targets)
        if loaded is not None and loaded.generation is not None:
            self._last_generation = loaded.generation
        return loaded

    @abstractmethod
    def payload_for(self, model: nn.Module, optimizer: Any, params: Params) -> tuple[Any, ...]:
        """What `save` takes to checkpoint a job's model and optimizer (live, not copied)."""

    @abstractmethod
    def restore_for(self, objective: str, params: Params) -> Restore | None:
        """Read and check the committed checkpoint for a job (collective); None when there
        is none. Raises `ObjectiveMismatchError`, `TrainableStateError` or a checkpoint
        error before anything changes."""

    # ---- what a layout implements --------------------------------------------------------
    @abstractmethod
    def _check_payload(self, payload: tuple[Any, ...]) -> None:
        """Refuse a payload this layout cannot save (`TypeError`), before anything happens."""

    @abstractmethod
    def _stage(
        self, payload: tuple[Any, ...], step: int, objective: str, *, snapshot: bool
    ) -> Staged:
        """On the caller's thread: everything that must happen at the call (with `snapshot`,
        the host copy). Raises only when every rank does."""

    @abstractmethod
    def _write(self, staged: Staged, group: RankGroup) -> list[FileRecord] | BaseException:
        """Write this rank's files durably (collectives on `group` only); this rank's file
        records, or its error (returned, so every rank reaches the barrier)."""

    @abstractmethod
    def _check_commit(self, manifest: Manifest) -> None:
        """Rank 0, right before the commit: a last look at the generation on disk (raise to
        refuse the commit)."""

    @abstractmethod
    def _load(self, *targets: Any) -> LoadedCheckpoint | None: ...

    # ---- the shared protocol -------------------------------------------------------------
    def _check_save(self, payload: tuple[Any, ...], step: int) -> None:
        self._check_payload(payload)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")

    def _lane_ranks(self) -> tuple[int, ...] | None:
        if self.group.group is None:
            return None
        return tuple(dist.get_process_group_ranks(self.group.group))

    def _save_failed(self, step: int) -> Callable[[list[str]], Exception]:
        kept = "none" if self._last_generation is None else f"generation {self._last_generation}"
        return lambda failures: CheckpointSaveError(
            f"save of step {step} to {self.directory} failed: {'; '.join(failures)}. "
            f"The last committed checkpoint ({kept}) stays in effect."
        )

    def _choose_generation(
        self, group: RankGroup, step: int, reserve: Callable[[int], None] | None = None
    ) -> int:
        """Rank 0 numbers the new generation (committed + 1), so every rank agrees even if
        their views of the directory differ; `reserve` prepares its name on disk."""

        def decide() -> int:
            if self._last_generation is None:
                committed = self.latest()
                self._last_generation = committed.generation if committed else 0
            generation = self._last_generation + 1
            if reserve is not None:
                reserve(generation)
            return generation

        return decide_on_first(group, decide, self._save_failed(step))

    def _write_and_commit(self, staged: Staged, group: RankGroup) -> Manifest:
        """The save after staging: write, agree, commit (on `group`: the checkpointer's for
        `save`, the lane's for `save_async`)."""
        try:
            failed = self._save_failed(staged.step)
            local = self._write(staged, group)
            staged.data = None  # drop the snapshot before the collectives
            outcomes = gather_or_raise(group, local, failed)
            assert staged.generation is not None
            manifest = Manifest(
                generation=staged.generation,
                step=staged.step,
                world_size=group.world_size,
                objective=staged.objective,
                files=tuple(
                    sorted(
                        (r for records in outcomes for r in records),
                        key=lambda r: (r.rank or 0, r.name),
                    )
                ),
                layout=self.layout,
            )
            commit(
                group,
                self.io,
                self.directory,
                manifest,
                failed,
                check=lambda: self._check_commit(manifest),
            )
        except BaseException:
            # Reread the manifest before the next save: a failed commit may or may not have
            # advanced it, and a new generation must never reuse a committed one's name.
            self._last_generation = None
            raise
        self._last_generation = manifest.generation
        return manifest
