"""The commit protocol both checkpoint layouts share: agree on every rank, then one rename.

Why one module: a generation is committed exactly when rank 0 atomically replaces
`CURRENT.json` after every rank reported its files durable; whatever the layout writes
before that, a crash leaves the previous manifest, and so the previous generation, in
effect. The steps (rank 0 decides and broadcasts; all ranks gather their outcomes; rank 0
writes the manifest, fsyncs, renames, fsyncs the directory and only then removes what the
manifest does not name; the outcome is broadcast) and their failure rules (the rank that
failed raises its own error, every other rank a `CheckpointSaveError` or
`CheckpointCorruptError` naming it) are written once, here. docs/checkpoint-format.md,
"Commit protocol".
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from art_megatron_ext.optim.collective import RankGroup
from art_megatron_ext.optim.fileio import CheckpointIO
from art_megatron_ext.optim.manifest import MANIFEST_NAME, Manifest, is_checkpoint_file

__all__ = ["Failed", "commit", "decide_on_first", "gather_or_raise", "remove_uncommitted"]

logger = logging.getLogger(__name__)
T = TypeVar("T")
#: Builds the error raised on the ranks that did not fail, from every failure's text.
Failed = Callable[[list[str]], Exception]


@dataclass(frozen=True)
class _Failure:
    """What a rank sends instead of its outcome when its part failed (picklable)."""

    text: str


def _failure(rank: int, exc: BaseException, what: str = "") -> _Failure:
    return _Failure(f"rank {rank}{what}: {type(exc).__name__}: {exc}")


def _raise_failures(outcomes: list[Any], failed: Failed) -> None:
    texts = [o.text for o in outcomes if isinstance(o, _Failure)]
    if texts:
        raise failed(texts)


def decide_on_first(
    group: RankGroup, decide: Callable[[], T], failed: Failed, *, what: str = ""
) -> T:
    """Rank 0 runs `decide()`; every rank returns its result (a broadcast).

    If it raises, rank 0 re-raises that error and every other rank raises `failed(...)`.
    """
    value: Any = None
    error: BaseException | None = None
    if group.rank == 0:
        try:
            value = decide()
        except Exception as exc:
            value, error = _failure(0, exc, what), exc
    value = group.broadcast_from_first(value)
    if error is not None:
        raise error
    _raise_failures([value], failed)
    return value


def gather_or_raise(group: RankGroup, local: T | BaseException, failed: Failed) -> list[T]:
    """Every rank's `local` outcome, by rank: the barrier of a save or a load.

    A rank whose `local` is an exception re-raises it; when any rank failed, the others raise
    `failed(...)` naming it. Send small outcomes only (file records, "ok"), never a state.
    """
    sent = _failure(group.rank, local) if isinstance(local, BaseException) else local
    outcomes = group.all_gather(sent)
    if isinstance(local, BaseException):
        raise local
    _raise_failures(outcomes, failed)
    return outcomes


def commit(
    group: RankGroup,
    io: CheckpointIO,
    directory: Path,
    manifest: Manifest,
    failed: Failed,
    *,
    check: Callable[[], None] | None = None,
) -> None:
    """Make `manifest` the commit of `directory` (collective; call after every rank's files
    are durable).

    Rank 0 runs `check` (a last look at the generation), writes `CURRENT.json.tmp`, fsyncs
    it, renames it over `CURRENT.json` (the commit) and fsyncs the directory; then it
    removes every checkpoint file the manifest does not name. The outcome is broadcast.
    """

    def publish() -> str:
        if check is not None:
            check()
        body = manifest.to_json()
        io.atomic_write(directory / MANIFEST_NAME, lambda sink: sink.write(body))
        io.fsync_dir(directory)
        remove_uncommitted(directory, manifest)
        return "ok"

    decide_on_first(group, publish, failed, what=" commit")


def remove_uncommitted(directory: Path, manifest: Manifest) -> None:
    """Delete every checkpoint file or generation directory `manifest` does not name (older
    generations, crashed saves, legacy shards, temporaries). Runs after the commit, so a
    failure is logged, not raised."""
    keep = manifest.kept_names() | {MANIFEST_NAME}
    for path in directory.iterdir():
        if path.name in keep or not is_checkpoint_file(path.name):
            continue
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError as exc:
            logger.warning("could not remove uncommitted checkpoint file %s: %s", path, exc)
