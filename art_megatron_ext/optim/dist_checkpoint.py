"""Adapter + optimizer checkpoints in Megatron's `dist_checkpointing`, committed atomically.

Why: `dist_checkpointing` stores sharded tensors by their global shape and offset, so a
checkpoint written at one parallel layout loads at another (DP=2 -> DP=1, TP=2 -> TP=1),
which the per-rank `ShardedCheckpointer` files cannot. It does not, however, say when a
checkpoint is complete, and it overwrites a directory in place. So each save goes into a new
generation directory `gen-GGGGGGGG.dist/`, every file gets an XXH3-128 digest (data files
hashed while Megatron writes them), and rank 0 commits by atomically replacing
`CURRENT.json` after every rank reported success; the previous generation is removed only
after that. Layout and guarantees: docs/checkpoint-format.md ("dist_checkpointing layout").

What is saved: the model's LoRA entries of `model.sharded_state_dict()` (keys containing
`.lora.`) and `optimizer.sharded_state_dict(...)` over them (a Megatron `DistributedOptimizer`
with the `fully_reshardable` layout).
"""

from __future__ import annotations

import builtins
import contextlib
import json
import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from art_megatron_ext import compat
from art_megatron_ext.optim.async_save import snapshot_state
from art_megatron_ext.optim.checkpoint import CheckpointCorruptError, CheckpointSaveError
from art_megatron_ext.optim.collective import RankGroup
from art_megatron_ext.optim.fileio import WRITE_DIGEST, CheckpointIO, digest_open_file, new_hasher
from art_megatron_ext.optim.manifest import MANIFEST_NAME, CheckpointFormatError
from art_megatron_ext.optim.optimizer_state import _unshare_step_tensors

__all__ = ["DistCheckpointer", "DistManifest", "LoadedDist"]

DIST_FORMAT = "art-pipeline/dist-checkpoint"
DIST_FORMAT_VERSION = 2  # written; 1 is read (see `_refuse_format1_gated_grouped`)
_READABLE_VERSIONS = (1, 2)
SHARDING_TYPE = "fully_reshardable"


def generation_dir_name(generation: int) -> str:
    return f"gen-{generation:08d}.dist"


@dataclass(frozen=True)
class DistFile:
    name: str  # relative to the generation directory, no path separators
    size: int
    digest: str


@dataclass(frozen=True)
class DistManifest:
    """The commit record of one `dist_checkpointing` generation."""

    generation: int
    step: int
    world_size: int  # of the job that saved it (any world size may load it)
    objective: str
    files: tuple[DistFile, ...]
    format_version: int = DIST_FORMAT_VERSION  # 1 only for a format-1 manifest read back

    @property
    def directory_name(self) -> str:
        return generation_dir_name(self.generation)

    def to_json(self) -> bytes:
        body = {
            "format": DIST_FORMAT,
            "format_version": DIST_FORMAT_VERSION,
            "generation": self.generation,
            "step": self.step,
            "world_size": self.world_size,
            "objective": self.objective,
            "layout": "megatron.core.dist_checkpointing/torch_dist",
            "directory": self.directory_name,
            "digest": WRITE_DIGEST,
            "files": [{"name": f.name, "size": f.size, "digest": f.digest} for f in self.files],
        }
        return (json.dumps(body, indent=1) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, source: Path) -> DistManifest:
        try:
            body = json.loads(data)
            if body.get("format") != DIST_FORMAT:
                raise CheckpointFormatError(
                    f"{source}: format is {body.get('format')!r}, expected {DIST_FORMAT!r} "
                    "(a per-rank checkpoint is read with ShardedCheckpointer)"
                )
            version = body.get("format_version")
            if (
                isinstance(version, bool)
                or version not in _READABLE_VERSIONS
                or body.get("digest") != WRITE_DIGEST
            ):
                raise CheckpointFormatError(
                    f"{source}: format_version {body.get('format_version')!r} / digest "
                    f"{body.get('digest')!r} not supported"
                )
            files = tuple(
                DistFile(str(f["name"]), int(f["size"]), str(f["digest"])) for f in body["files"]
            )
            manifest = cls(
                int(body["generation"]),
                int(body["step"]),
                int(body["world_size"]),
                str(body["objective"]),
                files,
                int(version),
            )
        except CheckpointFormatError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointFormatError(f"{source}: malformed manifest ({exc!r})") from exc
        for f in files:
            if Path(f.name).name != f.name or f.name in ("", ".", ".."):
                raise CheckpointFormatError(f"{source}: file name {f.name!r} is not plain")
        return manifest


@dataclass(frozen=True)
class LoadedDist:
    step: int
    objective: str
    generation: int
    directory: Path


class _HashingFile:
    """A binary file whose writes go through `io.write` and are hashed on their way out;
    the digest is recorded at close."""

    def __init__(self, raw: Any, path: Path, watch: _Watch) -> None:
        self._raw, self._path, self._watch = raw, path, watch
        self._hasher = new_hasher()
        self._size = 0
        self._rewound = False  # a seek back means the write order is not the file order

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._hasher.update(view)
        self._watch.io.write(self._raw, view)
        self._size += view.nbytes
        return view.nbytes

    def seek(self, *args):
        self._rewound = True
        return self._raw.seek(*args)

    def truncate(self, *args):
        self._rewound = True
        return self._raw.truncate(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    def __enter__(self) -> _HashingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._raw.closed:
            return
        self._raw.close()
        if self._rewound:  # fall back to a read pass for this one file
            with builtins.open(self._path, "rb") as f:
                digest = digest_open_file(f, self._path.stat().st_size)
            size = self._path.stat().st_size
        else:
            digest, size = self._hasher.hexdigest(), self._size
        with _WATCH_LOCK:
            self._watch.record[self._path.name] = (size, digest)


@dataclass
class _Watch:
    io: CheckpointIO
    record: dict[str, tuple[int, str]]


# Generation directories whose Megatron data-file writes are being hashed (several saves of
# different checkpointers may overlap, each in its own directory).
_WATCHED: dict[Path, _Watch] = {}
_WATCH_LOCK = threading.Lock()
_NO_OPEN = object()  # the writer module had no `open` of its own (it uses the builtin)
_SAVED_OPEN: list[Any] = []


def _hashing_open(file, mode="r", *args, **kwargs):
    raw = builtins.open(file, mode, *args, **kwargs)  # noqa: SIM115 (closed by wrapper)
    if "w" in mode and "b" in mode:
        path = Path(file)
        with _WATCH_LOCK:
            watch = _WATCHED.get(path.parent)
        if watch is not None:
            return _HashingFile(raw, path, watch)
    return raw


@contextlib.contextmanager
def _hash_megatron_writes(directory: Path, io: CheckpointIO) -> Iterator[dict[str, tuple]]:
    """While active, Megatron's data-file writes into `directory` go through `io.write` and
    are hashed in-flight (a module-level `open` bound in Megatron's writer module while any
    save is active)."""
    module = compat.dist_ckpt_writer_module()
    watch = _Watch(io, {})
    with _WATCH_LOCK:
        if not _WATCHED:
            _SAVED_OPEN[:] = [module.__dict__.get("open", _NO_OPEN)]
            module.open = _hashing_open
        _WATCHED[directory] = watch
    try:
        yield watch.record
    finally:
        with _WATCH_LOCK:
            del _WATCHED[directory]
            if not _WATCHED:
                (saved,) = _SAVED_OPEN
                if saved is _NO_OPEN:
                    del module.open
                else:
                    module.open = saved


def lora_sharded_state_dict(model: Any, metadata: dict) -> dict:
    """The LoRA entries of `model.sharded_state_dict(metadata=...)` (the adapter)."""
    return {k: v for k, v in model.sharded_state_dict(metadata=metadata).items() if ".lora." in k}


def _snapshot_buckets(buckets: list) -> list:
    """Megatron's write buckets with every tensor copied into host memory (the snapshot)."""
    return [
        (path, name, (bytes_data, [(item, snapshot_state(t)) for item, t in tensors]))
        for path, name, (bytes_data, tensors) in buckets
    ]


@dataclass
class _Prepared:
    """A planned save: everything but the local write and the collective finalize."""

    step: int
    objective: str
    generation: int
    gen_dir: Path
    parts: compat.DistAsyncParts | None  # None when planning failed on this rank
    error: str | None = None


#: The checkpoint-only gloo group, one per process and default group: every checkpointer
#: (the resident store makes a new one on each reload) shares it, so groups do not pile up.
_GLOO_GROUP: tuple[object, object] | None = None


def _checkpoint_gloo_group():
    """A gloo group over the world for background collectives, created once (collectively)."""
    global _GLOO_GROUP
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    if _GLOO_GROUP is None or _GLOO_GROUP[0] is not world:  # first use, or a new default group
        _GLOO_GROUP = (world, dist.new_group(backend="gloo"))
    return _GLOO_GROUP[1]


class DistCheckpointer:
    """Save/load an adapter and its `DistributedOptimizer` with `dist_checkpointing` (collective).

    `model` is the Megatron module (inside DDP: `ddp.module`) whose `sharded_state_dict`
    names the LoRA tensors; `optimizer` is Megatron's (chained) distributed optimizer over it.
    `save` is synchronous; `save_async` blocks only for planning and the in-memory snapshot
    and writes, digests and commits on a background thread (collectives of that thread run
    on a gloo group of its own). Saves are ordered: `save`, `save_async`, `load`, `wait` and
    `close` first wait for a background save's commit.
    """

    def __init__(self, directory: Path, *, io: CheckpointIO | None = None) -> None:
        self.directory = Path(directory)
        self.io = io or CheckpointIO()
        self.group = RankGroup(None)  # dist_checkpointing itself plans on the default group
        self._background_group: RankGroup | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[DistManifest] | None = None
        self._pending_step: int | None = None

    @staticmethod
    def _check_optimizer(optimizer: Any) -> None:
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

    def committed(self) -> DistManifest | None:
        path = self.directory / MANIFEST_NAME
        try:
            data = self.io.read_bytes(path)
        except FileNotFoundError:
            return None
        return DistManifest.from_json(data, path)

    # ---- save ----------------------------------------------------------------------------
    def save(self, model: Any, optimizer: Any, *, step: int, objective: str) -> DistManifest:
        """Write and commit a new generation (collective); returns its manifest. On failure
        every rank raises `CheckpointSaveError` and the last committed generation stays."""
        self._check_optimizer(optimizer)
        self._check_step(step)
        self.wait()
        prepared = self._prepare(model, optimizer, step, objective, snapshot=False)
        return self._write_and_commit(prepared, self.group)

    def save_async(self, model: Any, optimizer: Any, *, step: int, objective: str) -> Future:
        """Plan and snapshot a new generation now; write, digest and commit it in the
        background (collective). Returns the save's future (its manifest).

        Waits for the previous background save first and raises its error if it failed
        (nothing new is queued then). When this returns, the caller may change the model and
        optimizer: what is written is the state at the call. A crash before the commit leaves
        the last committed generation.
        """
        self._check_optimizer(optimizer)
        self._check_step(step)
        self.wait()
        if self._background_group is None:  # collective: every rank's first save_async
            self._background_group = RankGroup(_checkpoint_gloo_group())
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="dist-ckpt-async")
        prepared = self._prepare(model, optimizer, step, objective, snapshot=True)
        assert self._executor is not None
        self._pending = self._executor.submit(
            self._write_and_commit, prepared, self._background_group
        )
        self._pending_step = step
        return self._pending

    @property
    def pending_step(self) -> int | None:
        """The step of a background save that was queued and has not been waited for."""
        return self._pending_step

    def wait(self) -> DistManifest | None:
        """Wait for the background save's commit; its manifest, None if none was queued.
        A failed background save raises here, once."""
        pending, self._pending, self._pending_step = self._pending, None, None
        if pending is None:
            return None
        return pending.result()

    def close(self) -> DistManifest | None:
        """Wait for the background save and stop the background thread."""
        try:
            return self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    @staticmethod
    def _check_step(step: int) -> None:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")

    def _prepare(
        self, model: Any, optimizer: Any, step: int, objective: str, *, snapshot: bool
    ) -> _Prepared:
        """Pick the generation (rank 0), build the sharded state and let Megatron plan the
        save (main thread: collectives on the default group). With `snapshot`, the tensors
        this rank writes are copied to host memory before returning."""
        from megatron.core import dist_checkpointing

        rank = self.group.rank
        plan: int | str = "unset"
        if rank == 0:
            try:
                committed = self.committed()
                generation = (committed.generation if committed else 0) + 1
                gen_dir = self.directory / generation_dir_name(generation)
                if gen_dir.exists():  # debris of a crashed save under this name
                    shutil.rmtree(gen_dir)
                gen_dir.mkdir(parents=True)
                self.io.fsync_dir(self.directory)
                plan = generation
            except Exception as exc:
                plan = f"rank 0: {type(exc).__name__}: {exc}"
        plan = self.group.broadcast_from_first(plan)
        if isinstance(plan, str):
            raise CheckpointSaveError(f"save of step {step} to {self.directory} failed: {plan}")
        gen_dir = self.directory / generation_dir_name(plan)
        prepared = _Prepared(step, objective, plan, gen_dir, None)
        try:
            metadata = self._metadata()
            adapter = lora_sharded_state_dict(model, metadata)
            state = {
                "adapter": adapter,
                "optimizer": optimizer.sharded_state_dict(adapter, metadata=metadata),
            }
            request = dist_checkpointing.save(
                state, str(prepared.gen_dir), async_sharded_save=True, async_strategy="mcore"
            )
            parts = compat.dist_ckpt_async_parts(request)
            if snapshot:
                parts.write_buckets = _snapshot_buckets(parts.write_buckets)
            prepared.parts = parts
        except Exception as exc:
            prepared.error = f"rank {rank}: {type(exc).__name__}: {exc}"
        return prepared

    def _write_and_commit(self, prepared: _Prepared, group: RankGroup) -> DistManifest:
        """Write this rank's files (hashed on the way out), then finalize and commit over
        `group` (the default group for `save`, the background group for `save_async`)."""
        rank, gen_dir, step = group.rank, prepared.gen_dir, prepared.step
        outcome: dict | str = prepared.error or {}
        parts = prepared.parts
        if parts is not None:
            try:
                with _hash_megatron_writes(gen_dir, self.io) as written:
                    if parts.write_fn is not None:
                        parts.write_fn(parts.rank, parts.write_buckets, parts.results_queue)
                parts.write_buckets = []  # drop the snapshot before the collectives
                outcome = dict(written)
            except Exception as exc:
                outcome = f"rank {rank}: {type(exc).__name__}: {exc}"
            # Megatron's finalize gathers every rank's write results (also failures) and
            # writes `.metadata` on the coordinator; it must run on every rank.
            try:
                parts.dist_wrapper.group = group.group
                parts.finalize()
                if rank == 0:
                    compat.dist_ckpt_save_config(gen_dir)
            except Exception as exc:
                if not isinstance(outcome, str):
                    outcome = f"rank {rank}: {type(exc).__name__}: {exc}"
        if not isinstance(outcome, str) and rank == 0:
            try:  # small metadata files Megatron writes itself: hash and fsync them here
                for path in gen_dir.iterdir():
                    if path.name not in outcome and path.is_file():
                        with self.io.open_read(path) as f:
                            size = path.stat().st_size
                            outcome[path.name] = (size, digest_open_file(f, size))
                        with open(path, "rb+") as f:
                            self.io.fsync(f)
                self.io.fsync_dir(gen_dir)
            except Exception as exc:
                outcome = f"rank {rank}: {type(exc).__name__}: {exc}"
        outcomes = group.all_gather(outcome)  # every rank's files are durable past here
        failures = [o for o in outcomes if isinstance(o, str)]
        if failures:
            raise CheckpointSaveError(
                f"save of step {step} to {self.directory} failed: {'; '.join(failures)}. "
                "The last committed checkpoint stays in effect."
            )
        files: dict[str, tuple[int, str]] = {}
        for o in outcomes:
            files.update(o)
        manifest = DistManifest(
            generation=prepared.generation,
            step=step,
            world_size=group.world_size,
            objective=prepared.objective,
            files=tuple(DistFile(n, s, d) for n, (s, d) in sorted(files.items())),
        )
        commit = "ok"
        if rank == 0:
            try:
                on_disk = sorted(p.name for p in gen_dir.iterdir())
                if on_disk != sorted(files):
                    raise CheckpointSaveError(
                        f"{gen_dir}: files on disk {on_disk} are not the files the ranks "
                        f"reported {sorted(files)}"
                    )
                body = manifest.to_json()
                self.io.atomic_write(self.directory / MANIFEST_NAME, lambda sink: sink.write(body))
                self.io.fsync_dir(self.directory)
                self._remove_others(manifest)
            except Exception as exc:
                commit = f"rank 0 commit: {type(exc).__name__}: {exc}"
        commit = group.broadcast_from_first(commit)
        if commit != "ok":
            raise CheckpointSaveError(
                f"save of step {step} to {self.directory} failed: {commit}. The last committed "
                "checkpoint stays in effect."
            )
        return manifest

    def _remove_others(self, manifest: DistManifest) -> None:
        """Remove every generation directory but the committed one (after the commit)."""
        for path in self.directory.iterdir():
            if path.name == manifest.directory_name or not path.name.startswith("gen-"):
                continue
            if path.is_dir() and path.name.endswith(".dist"):
                shutil.rmtree(path, ignore_errors=True)

    # ---- load ----------------------------------------------------------------------------
    def load(self, model: Any, optimizer: Any) -> LoadedDist | None:
        """Load the committed generation into `model`'s LoRA tensors and `optimizer` (any
        parallel layout). Every file's digest is checked first (files split over ranks);
        on any mismatch every rank raises and nothing is loaded."""
        from megatron.core import dist_checkpointing

        self._check_optimizer(optimizer)
        self.wait()
        local: str = "ok"
        manifest = None
        try:
            manifest = self.committed()
            if manifest is not None:
                gen_dir = self.directory / manifest.directory_name
                for i, f in enumerate(manifest.files):
                    if i % self.group.world_size == self.group.rank:
                        self._verify(gen_dir, f, manifest)
        except Exception as exc:
            local = f"rank {self.group.rank}: {type(exc).__name__}: {exc}"
        failures = [o for o in self.group.all_gather(local) if o != "ok"]
        if failures:
            raise CheckpointCorruptError(
                f"loading {self.directory} failed; nothing was loaded: {'; '.join(failures)}"
            )
        if manifest is None:
            return None
        metadata = self._metadata()
        adapter = lora_sharded_state_dict(model, metadata)
        _refuse_format1_gated_grouped(manifest, adapter, self.directory)
        targets = {k: v.data for k, v in adapter.items()}
        compat.distopt_init_state(optimizer)
        state = {
            "adapter": adapter,
            "optimizer": optimizer.sharded_state_dict(adapter, is_loading=True, metadata=metadata),
        }
        loaded = dist_checkpointing.load(state, str(self.directory / manifest.directory_name))
        import torch

        with torch.no_grad():
            for key, dst in targets.items():
                src = loaded["adapter"][key]
                if src.data_ptr() != dst.data_ptr():
                    dst.copy_(src)
        compat.distopt_load_state_dict(optimizer, loaded["optimizer"])
        for part in compat.chained_parts(optimizer):
            _unshare_step_tensors(part.optimizer)
        return LoadedDist(manifest.step, manifest.objective, manifest.generation, self.directory)

    def _verify(self, gen_dir: Path, f: DistFile, manifest: DistManifest) -> None:
        path = gen_dir / f.name
        where = f"(generation {manifest.generation}, step {manifest.step})"
        try:
            handle = self.io.open_read(path)
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(
                f"{path}: listed in the manifest but missing {where}"
            ) from exc
        with handle:
            size = handle.seek(0, 2)
            got = digest_open_file(handle, size) if size == f.size else None
        if size != f.size or got != f.digest:
            raise CheckpointCorruptError(
                f"{path}: size {size} / {WRITE_DIGEST} {got} does not match the manifest's "
                f"{f.size} / {f.digest} {where}"
            )


def _refuse_format1_gated_grouped(manifest: DistManifest, adapter: dict, directory: Path) -> None:
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
