"""The per-rank layout: one shard file per rank, committed by the shared manifest.

Why: a trainer killed at any moment (preemption, OOM killer, SIGKILL) must restart from a
complete generation, never from a mix of two. Each rank writes its shard to `<name>.tmp`,
fsyncs and renames it; then the shared commit (`commit.py`: barrier, atomic replace of
`CURRENT.json`, removal of older files) runs. Readers trust only the manifest and verify
every digest in the pass that loads the shard. Fast, but loads only at the world size that
wrote it (the dist_checkpointing layout reshards). Format: docs/checkpoint-format.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from art_megatron_ext.optim.async_save import snapshot_state
from art_megatron_ext.optim.checkpointer import Checkpointer, LoadedCheckpoint, Restore, Staged
from art_megatron_ext.optim.collective import RankGroup
from art_megatron_ext.optim.commit import gather_or_raise
from art_megatron_ext.optim.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointWorldSizeError,
)
from art_megatron_ext.optim.fileio import CheckpointIO, digest_open_file, load_and_digest
from art_megatron_ext.optim.manifest import (
    LEGACY_SHARD_RE,
    MANIFEST_NAME,
    CheckpointLayout,
    FileRecord,
    Manifest,
    shard_name,
)
from art_megatron_ext.optim.training_state import (
    Params,
    TrainableStateError,
    apply_job_state,
    job_state,
    validated_job_state,
)

__all__ = ["CheckpointConfig", "ShardedCheckpointer"]

_PROC_FD = Path("/proc/self/fd").is_dir()  # open the same file again by its descriptor


def _to_device(state: Any, device: str) -> Any:
    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, dict):
        return type(state)((k, _to_device(v, device)) for k, v in state.items())
    if isinstance(state, (list, tuple)):
        return type(state)(_to_device(v, device) for v in state)
    return state


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how a `ShardedCheckpointer` reads and writes.

    Attributes:
        directory: the checkpoint directory (shared by all ranks of the job).
        map_location: device that loaded tensors land on.
        weights_only: passed to `torch.load`; True refuses arbitrary pickled objects.
    """

    directory: Path
    map_location: str = "cpu"
    weights_only: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "directory", Path(self.directory))


class ShardedCheckpointer(Checkpointer):
    """Saves and loads this rank's shard of a checkpoint directory (`Checkpointer`).

    `save(state, step=, objective=)` writes any tree of tensors and plain values that
    `torch.load(weights_only=...)` reads back; `load()` returns this rank's state in
    `LoadedCheckpoint.state`.
    """

    layout = CheckpointLayout.PER_RANK

    def __init__(
        self, config: CheckpointConfig, *, group: Any = None, io: CheckpointIO | None = None
    ):
        super().__init__(config.directory, group=group, io=io)
        self.config = config

    # ---- for the resident store ----------------------------------------------------------
    def payload_for(self, model: nn.Module, optimizer: Any, params: Params) -> tuple[Any, ...]:
        return (job_state(optimizer, params),)

    def restore_for(self, objective: str, params: Params) -> Restore | None:
        loaded = self.load()
        restored: Any = None
        try:
            if loaded is not None:
                restored = validated_job_state(
                    loaded.path, loaded.objective, objective, params, loaded.state
                )
            local: Any = "ok"
        except Exception as exc:  # every rank must reach the barrier, or the others hang
            local = exc
        gather_or_raise(
            self.group,
            local,
            lambda refusals: TrainableStateError(
                f"another rank refused checkpoint {self.directory}: {refusals[0]}"
            ),
        )
        if loaded is None:
            return None
        trainable, optim_state = restored
        return Restore(
            step=loaded.step or 0,
            apply=lambda _model, optimizer, params: apply_job_state(
                optimizer, params, trainable, optim_state, str(loaded.path)
            ),
        )

    # ---- writing -------------------------------------------------------------------------
    def _check_payload(self, payload: tuple[Any, ...]) -> None:
        if len(payload) != 1:
            raise TypeError(f"ShardedCheckpointer.save takes one state, got {len(payload)}")

    def _stage(
        self, payload: tuple[Any, ...], step: int, objective: str, *, snapshot: bool
    ) -> Staged:
        (state,) = payload
        return Staged(step, objective, snapshot_state(state) if snapshot else state)

    def _write(self, staged: Staged, group: RankGroup) -> list[FileRecord] | BaseException:
        staged.generation = self._choose_generation(group, staged.step)
        rank = group.rank
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            name = shard_name(staged.generation, rank, group.world_size)
            size, digest = self.io.atomic_write(
                self.directory / name, partial(torch.save, staged.data)
            )
            self.io.fsync_dir(self.directory)  # the rename is durable before any manifest
            return [FileRecord(name=name, size=size, digest=digest, rank=rank)]
        except Exception as exc:
            return exc

    def _check_commit(self, manifest: Manifest) -> None:
        """Nothing to add: each shard was renamed into place and fsynced by its writer, and
        the manifest names exactly the shards the ranks reported."""

    # ---- reading -------------------------------------------------------------------------
    def _load(self) -> LoadedCheckpoint | None:  # type: ignore[override]
        """This rank's shard of the committed generation (or of a legacy shard set)."""
        try:
            loaded: LoadedCheckpoint | BaseException | None = self._load_local()
        except Exception as exc:  # every rank must reach the barrier, or the others hang
            loaded = exc
        gather_or_raise(
            self.group,
            loaded if isinstance(loaded, BaseException) else "ok",
            lambda failures: CheckpointCorruptError(
                f"loading {self.directory} failed on another rank; nothing was loaded: "
                + "; ".join(failures)
            ),
        )
        assert not isinstance(loaded, BaseException)
        return loaded

    def _load_local(self) -> LoadedCheckpoint | None:
        manifest = self.latest()
        if manifest is None:
            return self._load_legacy()
        self._check_world_size(manifest.world_size)
        record = manifest.shard_for(self.group.rank)
        path = self.directory / record.name
        return LoadedCheckpoint(
            step=manifest.step,
            objective=manifest.objective,
            generation=manifest.generation,
            path=path,
            state=self._load_verified(path, record, manifest),
        )

    def _load_verified(self, path: Path, record: FileRecord, manifest: Manifest) -> Any:
        """Deserialize the shard and compute its digest in one pass (`load_and_digest`):
        every byte is read once, and the bytes that were verified are the bytes that were
        loaded even if the name is replaced meanwhile (one open file, `/proc/self/fd/N`).
        A state whose digest does not match is discarded.
        """
        where = (
            f"(generation {manifest.generation}, step {manifest.step} of "
            f"{self.directory / MANIFEST_NAME})"
        )
        try:
            f = self.io.open_read(path)
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(
                f"{path}: shard listed in the manifest is missing {where}"
            ) from exc
        with f:
            size = os.fstat(f.fileno()).st_size
            if size != record.size:
                raise CheckpointCorruptError(
                    f"{path}: size {size} bytes does not match the manifest's {record.size} {where}"
                )
            try:
                state, got = load_and_digest(
                    f"/proc/self/fd/{f.fileno()}" if _PROC_FD else str(path),
                    size,
                    weights_only=self.config.weights_only,
                    name=manifest.digest_name,
                )
                if self.config.map_location != "cpu":
                    state = _to_device(state, self.config.map_location)
                load_error = None
            except Exception as exc:  # judged by the digest: corruption explains it
                state, load_error = None, exc
                got = digest_open_file(f, size, manifest.digest_name)
        if got != record.digest:
            raise CheckpointCorruptError(
                f"{path}: {manifest.digest_name} digest {got} does not match the manifest's "
                f"{record.digest} "
                f"{where}; the file is corrupt or was replaced. Nothing was loaded."
            ) from load_error
        if load_error is not None:
            raise load_error
        return state

    def _check_world_size(self, saved: int) -> None:
        if saved != self.group.world_size:
            raise CheckpointWorldSizeError(
                f"checkpoint {self.directory} was saved by {saved} ranks but this job has "
                f"{self.group.world_size}; resharding is not supported. Restart with world size "
                f"{saved}, or point the job at another directory to start fresh (the "
                "dist_checkpointing layout reshards). Nothing was loaded."
            )

    def legacy_shards(self) -> dict[int, Path]:
        """Plain `NN-of-MM.pt` shards (the pre-manifest layout), keyed by rank."""
        found: dict[int, dict[int, Path]] = {}
        if not self.directory.is_dir():
            return {}
        for path in self.directory.iterdir():
            match = LEGACY_SHARD_RE.match(path.name)
            if match:
                found.setdefault(int(match.group(2)), {})[int(match.group(1))] = path
        if not found:
            return {}
        if len(found) > 1:
            raise CheckpointFormatError(
                f"{self.directory}: legacy shards for several world sizes {sorted(found)}; "
                "remove the stale set. Nothing was loaded."
            )
        ((total, shards),) = found.items()
        if sorted(shards) != list(range(total)):
            raise CheckpointFormatError(
                f"{self.directory}: legacy shard set of {total} is incomplete (have ranks "
                f"{sorted(shards)}). Nothing was loaded."
            )
        return shards

    def _load_legacy(self) -> LoadedCheckpoint | None:
        shards = self.legacy_shards()
        if not shards:
            return None
        self._check_world_size(len(shards))
        path = shards[self.group.rank]
        with self.io.open_read(path) as f:
            state = torch.load(
                f, map_location=self.config.map_location, weights_only=self.config.weights_only
            )
        return LoadedCheckpoint(
            step=None, objective=None, generation=None, path=path, state=state, legacy=True
        )
