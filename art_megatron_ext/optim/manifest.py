"""The checkpoint manifest (`CURRENT.json`) of both layouts, and the file names it governs.

Why: a reader must tell a committed generation from debris left by a crash without trusting
directory listings. The manifest is the single commit record of a checkpoint directory,
whichever layout wrote it: it names every file of the generation with its size and digest;
anything else in the directory is ignored, and removed by the next commit. Both layouts use
this one `Manifest`; on disk they differ only in the `format` string, the per-file `rank`
(per-rank layout) and the generation directory (dist_checkpointing layout), exactly as
docs/checkpoint-format.md specifies, so files written by earlier releases stay readable.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from art_megatron_ext.optim.errors import CheckpointFormatError
from art_megatron_ext.optim.fileio import LEGACY_DIGEST, WRITE_DIGEST

__all__ = [
    "MANIFEST_NAME",
    "CheckpointFormatError",
    "CheckpointLayout",
    "FileRecord",
    "Manifest",
    "generation_dir_name",
    "is_checkpoint_file",
    "shard_name",
]

MANIFEST_NAME = "CURRENT.json"
FORMAT_VERSION = 2  # what is written


class CheckpointLayout(enum.Enum):
    """How a generation's files are laid out (docs/checkpoint-format.md).

    PER_RANK: one file per rank (`ShardedCheckpointer`); any optimizer; loads only at the
    saving layout. DIST: Megatron `dist_checkpointing` in a generation directory
    (`DistCheckpointer`); Megatron's DistributedOptimizer only; loads at any TP/DP layout.
    """

    PER_RANK = "per-rank"
    DIST = "dist_checkpointing"


@dataclass(frozen=True)
class _Format:
    name: str  # the manifest's `format`
    digests: dict[int, tuple[str, str]]  # format_version -> (algorithm, per-file field)


_FORMATS = {
    # Per-rank format 1 recorded BLAKE2b-256 digests in a field named `blake2b`.
    CheckpointLayout.PER_RANK: _Format(
        "art-pipeline/sharded-checkpoint",
        {1: (LEGACY_DIGEST, "blake2b"), 2: (WRITE_DIGEST, "digest")},
    ),
    # Dist format 1 differs in how grouped-expert LoRA B is stored, not in the manifest.
    CheckpointLayout.DIST: _Format(
        "art-pipeline/dist-checkpoint", {1: (WRITE_DIGEST, "digest"), 2: (WRITE_DIGEST, "digest")}
    ),
}
_BY_NAME = {f.name: layout for layout, f in _FORMATS.items()}
DIST_STORAGE = "megatron.core.dist_checkpointing/torch_dist"  # the dist manifest's `layout`

# gen-00000007.rank-00001-of-00002.pt
_SHARD_RE = re.compile(r"^gen-(\d{8})\.rank-(\d{5})-of-(\d{5})\.pt$")
# gen-00000007.dist/ (a dist_checkpointing generation directory)
_GEN_DIR_RE = re.compile(r"^gen-(\d{8})\.dist$")
# Legacy (pre-manifest) layout: 00-of-02.pt
LEGACY_SHARD_RE = re.compile(r"^(\d+)-of-(\d+)\.pt$")


def shard_name(generation: int, rank: int, world_size: int) -> str:
    return f"gen-{generation:08d}.rank-{rank:05d}-of-{world_size:05d}.pt"


def generation_dir_name(generation: int) -> str:
    return f"gen-{generation:08d}.dist"


def is_checkpoint_file(name: str) -> bool:
    """True for every name a save of either layout may leave behind (shards, generation
    directories, legacy shards, temporaries)."""
    base = name.removesuffix(".tmp")
    return bool(
        _SHARD_RE.match(base)
        or _GEN_DIR_RE.match(base)
        or LEGACY_SHARD_RE.match(base)
        or base == MANIFEST_NAME
    )


@dataclass(frozen=True)
class FileRecord:
    """One file of a generation: a rank's shard (per-rank layout, `rank` set) or a file of
    the generation directory (dist layout, `rank` None)."""

    name: str
    size: int
    digest: str  # hex, of the manifest's digest algorithm
    rank: int | None = None


@dataclass(frozen=True)
class Manifest:
    """The commit record of one checkpoint generation, in either layout."""

    generation: int
    step: int
    world_size: int  # ranks that saved it (dist layout: informational, any size may load)
    objective: str
    files: tuple[FileRecord, ...]
    layout: CheckpointLayout = CheckpointLayout.PER_RANK
    format_version: int = FORMAT_VERSION  # older only for a manifest read back

    @property
    def digest_name(self) -> str:
        return _FORMATS[self.layout].digests[self.format_version][0]

    @property
    def directory_name(self) -> str | None:
        """The generation directory (dist layout), None for the per-rank layout."""
        if self.layout is CheckpointLayout.DIST:
            return generation_dir_name(self.generation)
        return None

    def kept_names(self) -> set[str]:
        """The directory entries this generation consists of (the commit keeps only these)."""
        if self.directory_name is not None:
            return {self.directory_name}
        return {r.name for r in self.files}

    def shard_for(self, rank: int) -> FileRecord:
        for record in self.files:
            if record.rank == rank:
                return record
        raise CheckpointFormatError(
            f"manifest generation {self.generation} has no shard for rank {rank}"
        )

    def to_json(self) -> bytes:
        if self.format_version != FORMAT_VERSION:
            raise ValueError(f"manifests are written as format_version {FORMAT_VERSION}")
        per_rank = self.layout is CheckpointLayout.PER_RANK
        body: dict[str, Any] = {
            "format": _FORMATS[self.layout].name,
            "format_version": FORMAT_VERSION,
            "generation": self.generation,
            "step": self.step,
            "world_size": self.world_size,
            "objective": self.objective,
        }
        if not per_rank:
            body.update(layout=DIST_STORAGE, directory=self.directory_name)
        body["digest"] = self.digest_name
        body["files"] = [
            ({"rank": f.rank} if per_rank else {})
            | {"name": f.name, "size": f.size, "digest": f.digest}
            for f in self.files
        ]
        return (json.dumps(body, indent=1) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, source: Path) -> Manifest:
        """Parse and check a manifest of either layout; `source` names it in every error."""
        try:
            body = json.loads(data)
            layout = _BY_NAME.get(body.get("format"))
            if layout is None:
                raise CheckpointFormatError(
                    f"{source}: format is {body.get('format')!r}, expected one of "
                    f"{sorted(_BY_NAME)}"
                )
            versions = _FORMATS[layout].digests
            version = body.get("format_version")
            if isinstance(version, bool) or version not in versions:
                raise CheckpointFormatError(
                    f"{source}: format_version {version!r} is not supported "
                    f"(this reader knows versions {sorted(versions)})"
                )
            digest_name, field = versions[version]
            if body.get("digest") != digest_name:
                raise CheckpointFormatError(
                    f"{source}: digest {body.get('digest')!r} is not supported by format_version "
                    f"{version} (expected {digest_name!r})"
                )
            per_rank = layout is CheckpointLayout.PER_RANK
            files = tuple(
                FileRecord(
                    name=str(f["name"]),
                    size=int(f["size"]),
                    digest=str(f[field]),
                    rank=int(f["rank"]) if per_rank else None,
                )
                for f in body["files"]
            )
            manifest = cls(
                generation=int(body["generation"]),
                step=int(body["step"]),
                world_size=int(body["world_size"]),
                objective=str(body["objective"]),
                files=files,
                layout=layout,
                format_version=version,
            )
        except CheckpointFormatError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointFormatError(f"{source}: malformed manifest ({exc!r})") from exc
        manifest._check_files(source)
        return manifest

    def _check_files(self, source: Path) -> None:
        """Refuse file lists a reader must not follow (paths, missing or repeated ranks)."""
        for r in self.files:
            if Path(r.name).name != r.name or r.name in ("", ".", ".."):
                raise CheckpointFormatError(f"{source}: file name {r.name!r} is not plain")
        if self.layout is not CheckpointLayout.PER_RANK:
            return
        ranks = sorted(r.rank for r in self.files)  # type: ignore[type-var]
        if ranks != list(range(self.world_size)):
            raise CheckpointFormatError(
                f"{source}: manifest lists ranks {ranks} for world size {self.world_size}"
            )
        for r in self.files:
            if not _SHARD_RE.match(r.name):
                raise CheckpointFormatError(
                    f"{source}: shard name {r.name!r} is not a plain shard file name"
                )
