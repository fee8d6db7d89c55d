"""The staging directory an update travels through, shared by the API server and the workers.

Why a directory: the API server has read and validated the adapter's bytes; the workers must
hold exactly those bytes, packed, before the engine's step loop is asked to swap them in. The
API server writes the validated bytes to a fresh directory on a memory-backed file system
(`/dev/shm` when present), so the workers never re-read the trainer's files: what was
validated is what is served, and the trainer may delete or rewrite its directory as soon as
the update returns. Each worker loads the staged copy on a background thread and leaves a
marker file, `ready.<rank>` or `failed.<rank>` (holding the error), that the API server
polls without involving the engine. The directory is removed when the update ends.

The API server and the workers must share the file system (one host): the plugin serves
single-node engines only.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

READY = "ready"
FAILED = "failed"
DEFAULT_SHM = Path("/dev/shm")
#: Documented override of where staging directories are made.
ENV_DIR = "ART_STAGING_DIR"


@dataclass(frozen=True)
class StagingConfig:
    """Where staging directories are created."""

    root: Path

    @classmethod
    def default(cls) -> StagingConfig:
        env = os.environ.get(ENV_DIR)
        if env:
            return cls(Path(env))
        if DEFAULT_SHM.is_dir() and os.access(DEFAULT_SHM, os.W_OK):
            return cls(DEFAULT_SHM)
        return cls(Path(tempfile.gettempdir()))


def new_stage_dir(config: StagingConfig, slot: str, version: int) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in slot)
    path = config.root / f"art-stage-{os.getpid()}-{safe}-{version}-{uuid.uuid4().hex[:8]}"
    path.mkdir(mode=0o700)
    return path


def marker_dir(stage_dir: str | Path, engine: int) -> Path:
    """Where DP engine `engine`'s workers leave their markers: every engine numbers its workers
    from 0, so each engine gets a directory of its own inside the stage directory."""
    path = Path(stage_dir) / f"markers-engine{engine}"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def write_files(stage_dir: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (stage_dir / name).write_bytes(data)


def mark(stage_dir: str | Path, rank: int, ok: bool, message: str = "") -> None:
    """Written by a worker once its staging thread ended (atomically: write, then rename)."""
    stage_dir = Path(stage_dir)
    final = stage_dir / f"{READY if ok else FAILED}.{rank}"
    tmp = stage_dir / f".{final.name}.tmp"
    try:
        tmp.write_text(message)
        tmp.rename(final)
    except OSError:
        pass  # the update was abandoned and its directory removed; nobody is waiting


def poll(stage_dir: str | Path, ranks: list[int]) -> tuple[list[int], dict[int, str]]:
    """(ranks ready, {rank: error} of ranks failed)."""
    stage_dir = Path(stage_dir)
    ready, failed = [], {}
    for rank in ranks:
        if (stage_dir / f"{READY}.{rank}").exists():
            ready.append(rank)
        elif (f := stage_dir / f"{FAILED}.{rank}").exists():
            failed[rank] = f.read_text(errors="replace")
    return ready, failed


def remove(stage_dir: str | Path) -> None:
    shutil.rmtree(stage_dir, ignore_errors=True)
