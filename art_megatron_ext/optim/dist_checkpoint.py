"""The dist_checkpointing layout: adapter + optimizer in Megatron's `dist_checkpointing`.

Why: `dist_checkpointing` stores sharded tensors by their global shape and offset, so a
checkpoint written at one parallel layout loads at another (DP=2 -> DP=1, TP=2 -> TP=1),
which the per-rank files cannot. It does not, however, say when a checkpoint is complete,
and it overwrites a directory in place. So each save goes into a new generation directory
`gen-GGGGGGGG.dist/`, every file gets an XXH3-128 digest (data files hashed while Megatron
writes them, `dist_write_hash.py`), and the shared commit (`commit.py`) replaces
`CURRENT.json` after every rank reported success; older generations are removed only after
that. Layout and guarantees: docs/checkpoint-format.md ("dist_checkpointing layout").

What is saved: the model's LoRA entries of `model.sharded_state_dict()` (keys containing
`.lora.`) and `optimizer.sharded_state_dict(...)` over them (a Megatron `DistributedOptimizer`
with the `fully_reshardable` layout).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from torch import nn

from art_megatron_ext import compat
from art_megatron_ext.optim.async_save import snapshot_state
from art_megatron_ext.optim.checkpointer import Checkpointer, LoadedCheckpoint, Restore, Staged
from art_megatron_ext.optim.collective import RankGroup
from art_megatron_ext.optim.commit import gather_or_raise
from art_megatron_ext.optim.dist_write_hash import hash_megatron_writes
from art_megatron_ext.optim.errors import CheckpointCorruptError, CheckpointSaveError
from art_megatron_ext.optim.fileio import WRITE_DIGEST, CheckpointIO, digest_open_file
from art_megatron_ext.optim.manifest import (
    MANIFEST_NAME,
    CheckpointFormatError,
    CheckpointLayout,
    FileRecord,
    Manifest,
    generation_dir_name,
)
from art_megatron_ext.optim.optimizer_state import _unshare_step_tensors
from art_megatron_ext.optim.training_state import Params, check_objective

__all__ = ["DistCheckpointer"]

SHARDING_TYPE = "fully_reshardable"


def lora_sharded_state_dict(model: Any, metadata: dict) -> dict:
    """The LoRA entries of `model.sharded_state_dict(metadata=...)` (the adapter)."""
    return {k: v for k, v in model.sharded_state_dict(metadata=metadata).items() if ".lora." in k}


def _megatron_module(model: nn.Module) -> nn.Module:
    """The Megatron module inside a DDP wrapper (its `sharded_state_dict` names the LoRA)."""
    return getattr(model, "module", model)


def _snapshot_buckets(buckets: list) -> list:
    """Megatron's write buckets with every tensor copied into host memory (the snapshot)."""
    return [
        (path, name, (bytes_data, [(item, snapshot_state(t)) for item, t in tensors]))
        for path, name, (bytes_data, tensors) in buckets
    ]


class DistCheckpointer(Checkpointer):
    """Save/load an adapter and its `DistributedOptimizer` with `dist_checkpointing`
    (`Checkpointer`; collective over the default group, where Megatron plans its saves).

    `save(model, optimizer, step=, objective=)` and `load(model, optimizer)`: `model` is the
    Megatron module (inside DDP: `ddp.module`) whose `sharded_state_dict` names the LoRA
    tensors; `optimizer` is Megatron's (chained) distributed optimizer over it. `save_async`
    plans the save and snapshots Megatron's write buckets on the caller's thread, since the
    planning is collective on the default group; the writes, Megatron's finalize (its group
    rebound to the lane's) and the commit run on the lane's thread.
    """

    layout = CheckpointLayout.DIST

    def __init__(self, directory: Path, *, io: CheckpointIO | None = None) -> None:
        super().__init__(directory, group=None, io=io)

    # ---- for the resident store ----------------------------------------------------------
    def payload_for(self, model: nn.Module, optimizer: Any, params: Params) -> tuple[Any, ...]:
        return (_megatron_module(model), optimizer)

    def restore_for(self, objective: str, params: Params) -> Restore | None:
        manifest = self._verified_committed()
        if manifest is None:
            return None
        check_objective(self.directory, manifest.objective, objective)
        return Restore(
            step=manifest.step,
            apply=lambda model, optimizer, _params: self._load_verified(
                manifest, _megatron_module(model), optimizer
            ),
        )

    # ---- writing -------------------------------------------------------------------------
    def _check_payload(self, payload: tuple[Any, ...]) -> None:
        if len(payload) != 2:
            raise TypeError(
                f"DistCheckpointer.save takes (model, optimizer), got {len(payload)} values"
            )
        optimizer = payload[1]
        if not type(optimizer).__module__.startswith("megatron.") or not all(
            compat.is_distributed_optimizer(p) for p in compat.chained_parts(optimizer)
        ):
            raise TypeError(
                f"DistCheckpointer needs Megatron's DistributedOptimizer (or a ChainedOptimizer "
                f"of them), got {type(optimizer).__name__}; checkpoint other optimizers with "
                "ShardedCheckpointer / ResidentOptimizerStore. Nothing was written or loaded."
            )

    def _metadata(self) -> dict:
        from megatron.core import parallel_state

        return {
            "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
            "distrib_optim_sharding_type": SHARDING_TYPE,
        }

    def _reserve(self, generation: int) -> None:
        """Rank 0: an empty `gen-G.dist/` (a stale one is debris of a crashed save: never
        committed), made durable before Megatron writes into it."""
        gen_dir = self.directory / generation_dir_name(generation)
        if gen_dir.exists():
            shutil.rmtree(gen_dir)
        gen_dir.mkdir(parents=True)
        self.io.fsync_dir(self.directory)

    def _stage(
        self, payload: tuple[Any, ...], step: int, objective: str, *, snapshot: bool
    ) -> Staged:
        """Pick the generation, build the sharded state and let Megatron plan the save (all
        collectives on the default group); with `snapshot`, copy this rank's write buckets
        to host memory. A planning error is kept for the write, so every rank still meets
        the others at the barrier."""
        from megatron.core import dist_checkpointing

        model, optimizer = payload
        generation = self._choose_generation(self.group, step, self._reserve)
        staged = Staged(step, objective, None, generation)
        try:
            metadata = self._metadata()
            adapter = lora_sharded_state_dict(model, metadata)
            state = {
                "adapter": adapter,
                "optimizer": optimizer.sharded_state_dict(adapter, metadata=metadata),
            }
            request = dist_checkpointing.save(
                state,
                str(self._gen_dir(generation)),
                async_sharded_save=True,
                async_strategy="mcore",
            )
            parts = compat.dist_ckpt_async_parts(request)
            if snapshot:
                parts.write_buckets = _snapshot_buckets(parts.write_buckets)
            staged.data = parts
        except Exception as exc:
            staged.data = exc
        return staged

    def _gen_dir(self, generation: int) -> Path:
        return self.directory / generation_dir_name(generation)

    def _write(self, staged: Staged, group: RankGroup) -> list[FileRecord] | BaseException:
        """This rank's data files (hashed on the way out), then Megatron's finalize (a
        gather of every rank's write results over `group`, `.metadata` on rank 0) and, on
        rank 0, `metadata.json` and the digests and fsyncs of those small files."""
        assert staged.generation is not None
        rank, gen_dir = group.rank, self._gen_dir(staged.generation)
        parts = staged.data
        if isinstance(parts, BaseException):
            return parts
        error: BaseException | None = None
        written: dict[str, tuple[int, str]] = {}
        try:
            with hash_megatron_writes(gen_dir, self.io) as written:
                if parts.write_fn is not None:
                    parts.write_fn(parts.rank, parts.write_buckets, parts.results_queue)
            parts.write_buckets = []  # drop the snapshot before the collectives
        except Exception as exc:
            error = exc
        # Megatron's finalize gathers every rank's write results (also failures) and writes
        # `.metadata` on the coordinator; it must run on every rank.
        try:
            parts.dist_wrapper.group = group.group
            parts.finalize()
            if rank == 0:
                compat.dist_ckpt_save_config(gen_dir)
        except Exception as exc:
            error = error or exc
        if error is not None:
            return error
        try:
            if rank == 0:  # small metadata files Megatron writes itself: hash and fsync here
                for path in gen_dir.iterdir():
                    # Data files (`*.distcp`) are reported by the rank that wrote them, hashed
                    # in flight; one that none reports fails the check before the commit.
                    if path.name not in written and path.suffix != ".distcp" and path.is_file():
                        with self.io.open_read(path) as f:
                            size = path.stat().st_size
                            written[path.name] = (size, digest_open_file(f, size))
                        with open(path, "rb+") as f:
                            self.io.fsync(f)
                self.io.fsync_dir(gen_dir)
        except Exception as exc:
            return exc
        return [FileRecord(name=n, size=s, digest=d) for n, (s, d) in written.items()]

    def _check_commit(self, manifest: Manifest) -> None:
        gen_dir = self._gen_dir(manifest.generation)
        on_disk = sorted(p.name for p in gen_dir.iterdir())
        reported = sorted(f.name for f in manifest.files)
        if on_disk != reported:
            raise CheckpointSaveError(
                f"{gen_dir}: files on disk {on_disk} are not the files the ranks reported "
                f"{reported}"
            )

    # ---- reading -------------------------------------------------------------------------
    def _load(self, model: Any, optimizer: Any) -> LoadedCheckpoint | None:  # type: ignore[override]
        """Load the committed generation into `model`'s LoRA tensors and `optimizer` (any
        parallel layout), after checking every file's digest."""
        self._check_payload((model, optimizer))
        manifest = self._verified_committed()
        if manifest is None:
            return None
        return self._load_verified(manifest, model, optimizer)

    def _verified_committed(self) -> Manifest | None:
        """The committed manifest after every file's size and digest was checked (files
        split over the ranks; collective). On any mismatch every rank raises and nothing is
        loaded. A separate read pass: Megatron's reader is not hooked."""
        manifest: Manifest | None = None
        try:
            manifest = self.latest()
            if manifest is not None:
                gen_dir = self.directory / str(manifest.directory_name)
                for i, f in enumerate(manifest.files):
                    if i % self.group.world_size == self.group.rank:
                        self._verify(gen_dir, f, manifest)
            local: Any = "ok"
        except Exception as exc:
            local = exc
        gather_or_raise(
            self.group,
            local,
            lambda failures: CheckpointCorruptError(
                f"loading {self.directory} failed on another rank; nothing was loaded: "
                + "; ".join(failures)
            ),
        )
        return manifest

    def _verify(self, gen_dir: Path, f: FileRecord, manifest: Manifest) -> None:
        path = gen_dir / f.name
        where = f"(generation {manifest.generation}, step {manifest.step})"
        try:
            handle = self.io.open_read(path)
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(
                f"{path}: listed in the manifest but missing {where}; nothing was loaded"
            ) from exc
        with handle:
            size = handle.seek(0, 2)
            got = digest_open_file(handle, size) if size == f.size else None
        if size != f.size or got != f.digest:
            raise CheckpointCorruptError(
                f"{path}: size {size} / {WRITE_DIGEST} {got} does not match the manifest's "
                f"{f.size} / {f.digest} {where}; the file is corrupt or was replaced, "
                "nothing was loaded"
            )

    def _load_verified(self, manifest: Manifest, model: Any, optimizer: Any) -> LoadedCheckpoint:
        from megatron.core import dist_checkpointing

        self._check_payload((model, optimizer))
        gen_dir = self.directory / str(manifest.directory_name)
        metadata = self._metadata()
        adapter = lora_sharded_state_dict(model, metadata)
        _refuse_format1_gated_grouped(manifest, adapter, self.directory)
        targets = {k: v.data for k, v in adapter.items()}
        compat.distopt_init_state(optimizer)
        state = {
            "adapter": adapter,
            "optimizer": optimizer.sharded_state_dict(adapter, is_loading=True, metadata=metadata),
        }
        loaded = dist_checkpointing.load(state, str(gen_dir))
        import torch

        with torch.no_grad():
            for key, dst in targets.items():
                src = loaded["adapter"][key]
                if src.data_ptr() != dst.data_ptr():
                    dst.copy_(src)
        compat.distopt_load_state_dict(optimizer, loaded["optimizer"])
        for part in compat.chained_parts(optimizer):
            _unshare_step_tensors(part.optimizer)
        self._last_generation = manifest.generation
        return LoadedCheckpoint(manifest.step, manifest.objective, manifest.generation, gen_dir)


def _refuse_format1_gated_grouped(manifest: Manifest, adapter: dict, directory: Path) -> None:
    """Format 1 stored a gated grouped-expert FC1's LoRA B padded and in per-rank
    [gate shard; up shard] order; format 2 stores [all gate; all up] (layout independent).
    Both can have the same global shape, so such a format-1 checkpoint would load with gate
    and up rows mixed: refuse it (every rank decides the same from the model)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if manifest.format_version != 1:
        return
    gated = sorted(
        k for k, v in adapter.items() if isinstance(v, ShardedTensorFactory) and v.data.dim() == 3
    )
    if gated:
        raise CheckpointFormatError(
            f"{directory / MANIFEST_NAME}: format_version 1 stored the gated grouped-expert "
            f"LoRA B ({gated[0]}{' and others' if len(gated) > 1 else ''}) in a per-rank "
            "order this release does not read back safely; load it with the release that "
            "wrote it and export the adapter to PEFT. Nothing was loaded."
        )
