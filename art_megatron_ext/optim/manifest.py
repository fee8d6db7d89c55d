"""The checkpoint manifest (`CURRENT.json`) and the file names it governs.

Why: a reader must be able to tell a committed generation from debris left by a crash
without trusting directory listings. The manifest is the single commit record: it names
every shard of the generation with its size and digest; anything else in the
directory is ignored. The layout is specified in docs/checkpoint-format.md.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from art_megatron_ext.optim.fileio import LEGACY_DIGEST, WRITE_DIGEST

MANIFEST_NAME = "CURRENT.json"
FORMAT_NAME = "art-pipeline/sharded-checkpoint"
FORMAT_VERSION = 2  # written; 1 (BLAKE2b-256 digests, field `blake2b`) is still read
# format_version -> (digest algorithm, name of the per-file digest field)
_DIGESTS = {1: (LEGACY_DIGEST, "blake2b"), 2: (WRITE_DIGEST, "digest")}
DIGEST_NAME = WRITE_DIGEST

# gen-00000007.rank-00001-of-00002.pt
_SHARD_RE = re.compile(r"^gen-(\d{8})\.rank-(\d{5})-of-(\d{5})\.pt$")
# Legacy (pre-manifest) layout: 00-of-02.pt
LEGACY_SHARD_RE = re.compile(r"^(\d+)-of-(\d+)\.pt$")


class CheckpointFormatError(RuntimeError):
    """A manifest or shard on disk does not match the checkpoint format."""


def shard_name(generation: int, rank: int, world_size: int) -> str:
    return f"gen-{generation:08d}.rank-{rank:05d}-of-{world_size:05d}.pt"


def is_checkpoint_file(name: str) -> bool:
    """True for every name a save of ours may leave behind (shards, legacy shards, temps)."""
    base = name.removesuffix(".tmp")
    return bool(_SHARD_RE.match(base) or LEGACY_SHARD_RE.match(base) or base == MANIFEST_NAME)


@dataclass(frozen=True)
class ShardRecord:
    """One shard file of a generation, as written by `rank`."""

    rank: int
    name: str
    size: int
    digest: str  # hex, of the manifest's digest algorithm


@dataclass(frozen=True)
class Manifest:
    """The commit record of one checkpoint generation."""

    generation: int
    step: int
    world_size: int
    objective: str
    files: tuple[ShardRecord, ...]
    digest_name: str = WRITE_DIGEST  # LEGACY_DIGEST only for a format-1 manifest read back

    def shard_for(self, rank: int) -> ShardRecord:
        for record in self.files:
            if record.rank == rank:
                return record
        raise CheckpointFormatError(
            f"manifest generation {self.generation} has no shard for rank {rank}"
        )

    def to_json(self) -> bytes:
        if self.digest_name != WRITE_DIGEST:
            raise ValueError(f"manifests are written with {WRITE_DIGEST}, not {self.digest_name}")
        body = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "generation": self.generation,
            "step": self.step,
            "world_size": self.world_size,
            "objective": self.objective,
            "digest": DIGEST_NAME,
            "files": [asdict(r) for r in self.files],
        }
        return (json.dumps(body, indent=1, sort_keys=False) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, source: Path) -> Manifest:
        try:
            body = json.loads(data)
            if body.get("format") != FORMAT_NAME:
                raise CheckpointFormatError(
                    f"{source}: format is {body.get('format')!r}, expected {FORMAT_NAME!r}"
                )
            version = body.get("format_version")
            if isinstance(version, bool) or version not in _DIGESTS:
                raise CheckpointFormatError(
                    f"{source}: format_version {version!r} is not supported "
                    f"(this reader knows versions {sorted(_DIGESTS)})"
                )
            digest_name, field = _DIGESTS[version]
            if body.get("digest") != digest_name:
                raise CheckpointFormatError(
                    f"{source}: digest {body.get('digest')!r} is not supported by format_version "
                    f"{version} (expected {digest_name!r})"
                )
            files = tuple(
                ShardRecord(
                    rank=int(f["rank"]),
                    name=str(f["name"]),
                    size=int(f["size"]),
                    digest=str(f[field]),
                )
                for f in body["files"]
            )
            manifest = cls(
                generation=int(body["generation"]),
                step=int(body["step"]),
                world_size=int(body["world_size"]),
                objective=str(body["objective"]),
                files=files,
                digest_name=digest_name,
            )
        except CheckpointFormatError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointFormatError(f"{source}: malformed manifest ({exc!r})") from exc
        if sorted(r.rank for r in files) != list(range(manifest.world_size)):
            raise CheckpointFormatError(
                f"{source}: manifest lists ranks {sorted(r.rank for r in files)} for world size "
                f"{manifest.world_size}"
            )
        for r in files:
            if Path(r.name).name != r.name or not _SHARD_RE.match(r.name):
                raise CheckpointFormatError(
                    f"{source}: shard name {r.name!r} is not a plain shard file name"
                )
        return manifest
