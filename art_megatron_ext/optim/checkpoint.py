"""Crash-atomic sharded checkpoints: one shard per rank, committed by a manifest.

Why: a trainer killed at any moment (preemption, OOM killer, SIGKILL) must restart from a
complete generation, never from a mix of two. Each rank writes its shard to `<name>.tmp`,
fsyncs and renames it; after a barrier rank 0 atomically replaces `CURRENT.json` (the only
commit record) and fsyncs the directory; only then are the previous generation's files
removed. Readers trust only the manifest and verify every digest. The on-disk layout is
specified in docs/checkpoint-format.md.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from art_megatron_ext.optim.collective import RankGroup
from art_megatron_ext.optim.fileio import CheckpointIO, digest_open_file, load_and_digest
from art_megatron_ext.optim.manifest import (
    LEGACY_SHARD_RE,
    MANIFEST_NAME,
    CheckpointFormatError,
    Manifest,
    ShardRecord,
    is_checkpoint_file,
    shard_name,
)

__all__ = [
    "CheckpointConfig",
    "CheckpointCorruptError",
    "CheckpointSaveError",
    "CheckpointWorldSizeError",
    "LoadedShard",
    "ShardedCheckpointer",
]

logger = logging.getLogger(__name__)
_PROC_FD = Path("/proc/self/fd").is_dir()  # open the same file again by its descriptor


def _to_device(state: Any, device: str) -> Any:
    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, dict):
        return type(state)((k, _to_device(v, device)) for k, v in state.items())
    if isinstance(state, (list, tuple)):
        return type(state)(_to_device(v, device) for v in state)
    return state


class CheckpointCorruptError(RuntimeError):
    """A shard listed in the manifest is missing, has the wrong size or the wrong digest."""


class CheckpointWorldSizeError(RuntimeError):
    """The checkpoint was written by a different number of ranks (resharding is not done)."""


class CheckpointSaveError(RuntimeError):
    """Another rank failed its part of a save; the previous generation stays committed."""


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


@dataclass(frozen=True)
class LoadedShard:
    """This rank's state from the committed generation (or from a legacy shard set)."""

    state: Any
    step: int | None  # None for legacy shards, which carry no manifest
    objective: str | None
    generation: int | None
    legacy: bool
    path: Path


class ShardedCheckpointer:
    """Saves and loads this rank's shard of a checkpoint directory.

    Every rank of `group` (default: the world, or a single process when torch.distributed is
    not initialized) must call `save` and `load` together: both are collective.
    """

    def __init__(
        self, config: CheckpointConfig, *, group: Any = None, io: CheckpointIO | None = None
    ):
        self.config = config
        self.group = RankGroup(group)
        self.io = io or CheckpointIO()
        self._last_generation: int | None = None

    @property
    def directory(self) -> Path:
        return self.config.directory

    # ---- reading -------------------------------------------------------------------------
    def committed(self) -> Manifest | None:
        """The manifest of the committed generation, or None when there is none."""
        path = self.directory / MANIFEST_NAME
        try:
            data = self.io.read_bytes(path)
        except FileNotFoundError:
            return None
        return Manifest.from_json(data, path)

    def load(self) -> LoadedShard | None:
        """Load this rank's shard of the committed generation (collective).

        Returns None when the directory holds no checkpoint. Raises on every rank when any
        rank's shard is missing or corrupt, or the world size differs; nothing is loaded then.
        """
        try:
            loaded: LoadedShard | str | None = self._load_local()
            local_error: BaseException | None = None
        except Exception as exc:  # every rank must reach the all-gather, or the others hang
            loaded, local_error = f"rank {self.group.rank}: {type(exc).__name__}: {exc}", exc
        outcomes = self.group.all_gather(loaded if isinstance(loaded, str) else "ok")
        if local_error is not None:
            raise local_error
        failures = [o for o in outcomes if o != "ok"]
        if failures:
            raise CheckpointCorruptError(
                f"loading {self.directory} failed on another rank; nothing was loaded: "
                + "; ".join(failures)
            )
        assert not isinstance(loaded, str)
        if loaded is not None and loaded.generation is not None:
            self._last_generation = loaded.generation
        return loaded

    def _load_local(self) -> LoadedShard | None:
        manifest = self.committed()
        if manifest is None:
            return self._load_legacy()
        self._check_world_size(manifest.world_size)
        record = manifest.shard_for(self.group.rank)
        path = self.directory / record.name
        state = self._load_verified(path, record, manifest)
        return LoadedShard(
            state=state,
            step=manifest.step,
            objective=manifest.objective,
            generation=manifest.generation,
            legacy=False,
            path=path,
        )

    def _load_verified(self, path: Path, record: ShardRecord, manifest: Manifest) -> Any:
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
                f"{saved}, or point the job at another directory to start fresh. "
                "Nothing was loaded."
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

    def _load_legacy(self) -> LoadedShard | None:
        shards = self.legacy_shards()
        if not shards:
            return None
        self._check_world_size(len(shards))
        path = shards[self.group.rank]
        with self.io.open_read(path) as f:
            state = torch.load(
                f, map_location=self.config.map_location, weights_only=self.config.weights_only
            )
        return LoadedShard(
            state=state, step=None, objective=None, generation=None, legacy=True, path=path
        )

    # ---- writing -------------------------------------------------------------------------
    def save(self, state: Any, *, step: int, objective: str) -> Manifest:
        """Write this rank's `state` as its shard of a new generation and commit it (collective).

        On success every rank returns the new manifest and the previous generation's files
        are gone. On failure every rank raises (the failing rank its own error, others
        `CheckpointSaveError`) and the previous committed generation stays loadable.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        try:
            return self._save(state, step, objective)
        except BaseException:
            # Re-read the manifest before the next save: a failed commit may or may not have
            # advanced it, and a new shard must never reuse a committed shard's name.
            self._last_generation = None
            raise

    def _save(self, state: Any, step: int, objective: str) -> Manifest:
        rank, world_size = self.group.rank, self.group.world_size
        # Rank 0 picks the generation so all ranks agree even if their views of the
        # directory differ (attribute caching on shared filesystems).
        plan: int | str = "unset"
        plan_error: BaseException | None = None
        if rank == 0:
            try:
                plan = self._next_generation()
            except Exception as exc:
                plan, plan_error = f"rank 0: {type(exc).__name__}: {exc}", exc
        plan = self.group.broadcast_from_first(plan)
        if plan_error is not None:
            raise plan_error
        if isinstance(plan, str):
            raise CheckpointSaveError(self._failure_text(step, [plan]))
        generation = plan

        local_error: BaseException | None = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            name = shard_name(generation, rank, world_size)
            size, digest = self.io.atomic_write(
                self.directory / name, lambda sink: torch.save(state, sink)
            )
            self.io.fsync_dir(self.directory)  # the rename is durable before any manifest names it
            outcome: ShardRecord | str = ShardRecord(rank=rank, name=name, size=size, digest=digest)
        except Exception as exc:
            outcome, local_error = f"rank {rank}: {type(exc).__name__}: {exc}", exc
        outcomes = self.group.all_gather(outcome)  # the barrier: every shard is durable here
        if local_error is not None:
            raise local_error
        failures = [o for o in outcomes if isinstance(o, str)]
        if failures:
            raise CheckpointSaveError(self._failure_text(step, failures))

        manifest = Manifest(
            generation=generation,
            step=step,
            world_size=world_size,
            objective=objective,
            files=tuple(sorted(outcomes, key=lambda r: r.rank)),  # type: ignore[union-attr]
        )
        commit_error: BaseException | None = None
        commit_outcome = "ok"
        if rank == 0:
            try:
                body = manifest.to_json()
                self.io.atomic_write(self.directory / MANIFEST_NAME, lambda sink: sink.write(body))
                self.io.fsync_dir(self.directory)
                self._remove_uncommitted(manifest)
            except Exception as exc:
                commit_error, commit_outcome = exc, f"rank 0 commit: {type(exc).__name__}: {exc}"
        commit_outcome = self.group.broadcast_from_first(commit_outcome)
        if commit_error is not None:
            raise commit_error
        if commit_outcome != "ok":
            raise CheckpointSaveError(self._failure_text(step, [commit_outcome]))
        self._last_generation = generation
        return manifest

    def _failure_text(self, step: int, failures: list[str]) -> str:
        kept = "none" if self._last_generation is None else f"generation {self._last_generation}"
        return (
            f"save of step {step} to {self.directory} failed: {'; '.join(failures)}. "
            f"The last committed checkpoint ({kept}) stays in effect."
        )

    def _next_generation(self) -> int:
        if self._last_generation is None:
            committed = self.committed()
            self._last_generation = committed.generation if committed else 0
        return self._last_generation + 1

    def _remove_uncommitted(self, manifest: Manifest) -> None:
        """Delete every checkpoint file the manifest does not list (old and crashed saves)."""
        keep = {r.name for r in manifest.files} | {MANIFEST_NAME}
        for path in self.directory.iterdir():
            if path.name in keep or not is_checkpoint_file(path.name):
                continue
            try:
                path.unlink()
            except OSError as exc:  # the commit already happened: report, do not fail the save
                logger.warning("could not remove uncommitted checkpoint file %s: %s", path, exc)
