"""Durable file operations for checkpoints: hashed writes, fsync, atomic rename.

Why a class: every way a checkpoint write can fail on a real disk (ENOSPC in a write, an
fsync that reports a lost page, a rename on a full directory) happens at one of the methods
below. Routing all of them through one small object lets tests inject a failure at each
write point in turn and prove that the last committed generation still loads.

Digest: XXH3-128 (`xxhash`), computed on the bytes as they are handed to the file, never in
a second pass. It detects torn, truncated and bit-flipped files (what a crash or a bad disk
produces) at memory speed; it is not a defence against deliberate tampering (see
docs/checkpoint-format.md). BLAKE2b-256 stays readable for format-1 manifests.
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

WRITE_DIGEST = "xxh3-128"  # what new manifests record (32 hex digits)
LEGACY_DIGEST = "blake2b-256"  # format-1 manifests: BLAKE2b with a 32-byte output
_HASHERS: dict[str, Callable[[], Any]] = {
    WRITE_DIGEST: xxhash.xxh3_128,
    LEGACY_DIGEST: lambda: hashlib.blake2b(digest_size=32),
}
_READ_CHUNK = 4 << 20  # buffer for verifying a shard's digest
_HOT_CHUNK = 1 << 20  # a storage is copied and hashed in pieces that stay in cache
_DIR_FSYNC_UNSUPPORTED = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}


def new_hasher(name: str = WRITE_DIGEST) -> Any:
    """A streaming hasher (`update`, `hexdigest`) for digest algorithm `name`."""
    try:
        return _HASHERS[name]()
    except KeyError:
        raise ValueError(f"unknown digest {name!r}; known: {sorted(_HASHERS)}") from None


class _HashingWriter:
    """File-like sink that hashes and counts every byte on its way to the real file.

    XXH3 runs at memory bandwidth (about 8 GB/s on one core here), so it hashes inline: the
    bytes are hashed while they are hot in cache, right before the same buffer is written.
    """

    def __init__(self, raw: BinaryIO, write: Callable[[BinaryIO, memoryview], None]) -> None:
        self._raw = raw
        self._write = write
        self.hasher = new_hasher()
        self.size = 0
        self.error: BaseException | None = None  # first failed write, re-raised by the caller

    def write(self, data) -> int:
        if self.error is not None:
            raise self.error
        view = memoryview(data).cast("B")
        self.hasher.update(view)
        try:
            self._write(self._raw, view)
        except BaseException as exc:
            self.error = exc
            raise
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._raw.flush()


class CheckpointIO:
    """The write points of a checkpoint save; subclass (in tests) to inject failures.

    Each public method is one write point. The defaults are the real operations.
    """

    def write(self, f: BinaryIO, data: memoryview) -> None:
        f.write(data)

    def fsync(self, f: BinaryIO) -> None:
        f.flush()
        os.fsync(f.fileno())

    def replace(self, src: Path, dst: Path) -> None:
        os.replace(src, dst)

    def fsync_dir(self, directory: Path) -> None:
        """Make renames in `directory` durable.

        Filesystems that cannot fsync a directory (EINVAL/ENOTSUP, e.g. some FUSE and network
        mounts) order metadata themselves; that is not a failure of the save.
        """
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        except OSError as exc:
            if exc.errno not in _DIR_FSYNC_UNSUPPORTED:
                raise
        finally:
            os.close(fd)

    # Reads are not failure points for the commit protocol; they are here so tests can count
    # them (a resident reuse must not touch the disk).
    def read_bytes(self, path: Path) -> bytes:
        return path.read_bytes()

    def open_read(self, path: Path) -> BinaryIO:
        return open(path, "rb")

    def atomic_write(
        self, path: Path, produce: Callable[[_HashingWriter], None]
    ) -> tuple[int, str]:
        """Write `path` crash-atomically; returns (size, XXH3-128 hex digest).

        `produce` writes the content into the given sink. The bytes go to `<path>.tmp`, which
        is flushed, fsynced and renamed over `path`; on any error the temporary file is
        removed and the error propagates, so `path` is either absent, its old content, or the
        complete new content. The caller fsyncs the directory once for all its renames.
        """
        tmp = path.with_name(path.name + ".tmp")
        sink: _HashingWriter | None = None
        try:
            with open(tmp, "wb") as raw:
                sink = _HashingWriter(raw, self.write)
                produce(sink)
                self.fsync(raw)
            self.replace(tmp, path)
        except BaseException as exc:
            tmp.unlink(missing_ok=True)
            # A serializer may wrap a failed write in its own error (torch.save raises
            # "unexpected pos" from its zip writer); surface the write's error (ENOSPC, EIO).
            if sink is not None and sink.error is not None and sink.error is not exc:
                raise sink.error from exc
            raise
        return sink.size, sink.hasher.hexdigest()


def file_digest(data: bytes | memoryview, name: str = WRITE_DIGEST) -> str:
    hasher = new_hasher(name)
    hasher.update(data)
    return hasher.hexdigest()


def digest_open_file(f: BinaryIO, size: int, name: str = WRITE_DIGEST) -> str:
    """Digest `name` of the first `size` bytes of an open file.

    Reads with `pread` (independent of the file position, so another reader may use the same
    file meanwhile) into one reused buffer. Not an mmap: a file truncated underneath would
    raise SIGBUS there, while here it gives a short read and thus a digest mismatch.
    """
    hasher = new_hasher(name)
    buf = bytearray(min(size, _READ_CHUNK) or 1)
    view = memoryview(buf)
    offset = 0
    while offset < size:
        n = os.preadv(f.fileno(), [view[: min(len(buf), size - offset)]], offset)
        if n == 0:
            break
        hasher.update(view[:n])
        offset += n
    return hasher.hexdigest()


def _tensors_by_storage(obj: Any, out: dict[int, tuple[Any, list]]) -> None:
    import torch

    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        if storage.nbytes():
            out.setdefault(storage.data_ptr(), (storage, []))[1].append(obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            _tensors_by_storage(value, out)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _tensors_by_storage(value, out)


def _data_record_spans(path: str) -> list[tuple[int, int]]:
    """(offset, size) of every non-empty storage record of a torch.save zip, by offset."""
    import zipfile

    import torch

    reader = torch._C.PyTorchFileReader(path)
    with zipfile.ZipFile(path) as archive:
        sizes = {i.filename: i.file_size for i in archive.infolist()}
    return sorted(  # the reader names records without the archive's top directory
        (reader.get_record_offset(name.split("/", 1)[1]), size)
        for name, size in sizes.items()
        if "/data/" in name and size > 0
    )


def load_and_digest(path: str, size: int, *, weights_only: bool, name: str = WRITE_DIGEST):
    """`torch.load(path)` into host memory and the digest of the file's first `size` bytes,
    in one pass over the bytes; returns (state, hex digest).

    Why: a separate verification pass reads every byte a second time; with no free core for
    a helper thread it costs as much as the load. Here `torch.load(mmap=True)` maps the file
    only to learn the structure (it reads the pickle and the zip directory; no tensor page is
    touched), then one in-order pass reads each storage with `pread` into private memory in
    1 MiB pieces, the same copy `torch.load` makes, and hashes every piece right after, while
    it is in cache; the bytes between storages (zip headers, the pickle) are read with
    `pread` for the digest. The tensors are then re-pointed at the private copies, so nothing
    stays mapped: the digest covers exactly the bytes the state holds.
    """
    import torch

    hasher = new_hasher(name)
    state = torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
    storages: dict[int, tuple[Any, list]] = {}
    _tensors_by_storage(state, storages)
    spans = _data_record_spans(path)
    if len(spans) != len(storages):
        raise ValueError(f"{path}: {len(spans)} storage records but {len(storages)} storages")
    base = min(storages) - (spans[0][0] if spans else 0)
    scratch = bytearray(_HOT_CHUNK)
    fd = os.open(path, os.O_RDONLY)
    try:

        def hash_file_range(start: int, stop: int) -> None:
            while start < stop:
                view = memoryview(scratch)[: min(_HOT_CHUNK, stop - start)]
                got = os.preadv(fd, [view], start)
                if got == 0:
                    return  # shorter than `size`: the digest will not match
                hasher.update(view[:got])
                start += got

        position = 0
        with torch.no_grad():
            for (offset, nbytes), ptr in zip(spans, sorted(storages), strict=True):
                storage, tensors = storages[ptr]
                if ptr - base != offset or storage.nbytes() != nbytes:
                    raise ValueError(f"{path}: storage at {offset} is not where torch mapped it")
                hash_file_range(position, offset)
                private = torch.empty(nbytes, dtype=torch.uint8)
                memory = memoryview(private.numpy())
                for start in range(0, nbytes, _HOT_CHUNK):
                    piece = memory[start : start + _HOT_CHUNK]
                    got = os.preadv(fd, [piece], offset + start)
                    hasher.update(piece[:got])  # short only if truncated: a mismatch
                copy = private.untyped_storage()
                for t in tensors:
                    t.set_(copy, t.storage_offset(), t.size(), t.stride())
                position = offset + nbytes
            hash_file_range(position, size)
    finally:
        os.close(fd)
    return state, hasher.hexdigest()
