"""Digests of Megatron's `dist_checkpointing` data files, computed while Megatron writes them.

Why: a second read pass over every data file to digest it would double the save's I/O.
Megatron's writer opens its files with `open` looked up in its own module; while any save is
active, that name is bound to `_hashing_open`, which wraps binary writes into a watched
generation directory so that each buffer goes through `CheckpointIO.write` (the tests'
failure points) and is hashed on its way out. A writer that seeks back falls back to
hashing that one file after it is closed.
"""

from __future__ import annotations

import builtins
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from art_megatron_ext import compat
from art_megatron_ext.optim.fileio import CheckpointIO, digest_open_file, new_hasher

__all__ = ["hash_megatron_writes"]


@dataclass
class _Watch:
    io: CheckpointIO
    record: dict[str, tuple[int, str]]  # file name -> (size, digest)


# Generation directories whose Megatron data-file writes are being hashed (several saves of
# different checkpointers may overlap, each in its own directory).
_WATCHED: dict[Path, _Watch] = {}
_WATCH_LOCK = threading.Lock()
_NO_OPEN = object()  # the writer module had no `open` of its own (it uses the builtin)
_SAVED_OPEN: list[Any] = []


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
def hash_megatron_writes(directory: Path, io: CheckpointIO) -> Iterator[dict[str, tuple]]:
    """While active, Megatron's data-file writes into `directory` go through `io.write` and
    are hashed in flight; yields {file name: (size, digest)}, filled as files close."""
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
