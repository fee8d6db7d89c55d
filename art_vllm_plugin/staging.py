"""The staging directory an update travels through, shared by the API server and the workers.

Why a directory: the API server has read and validated the adapter's bytes; the workers must
hold exactly those bytes, packed, before the engine's step loop is asked to swap them in. The
API server writes the validated bytes to a fresh directory on a memory-backed file system
(`/dev/shm` when present), so the workers never re-read the trainer's files: what was
validated is what is served, and the trainer may delete or rewrite its directory as soon as
the update returns. Each worker loads the staged copy on a background thread and leaves a
marker file, `ready.<rank>` or `failed.<rank>` (holding the error), that the API server
polls without involving the engine; while a full-weight update stages, each worker also keeps
a progress record there (`progress.<rank>`, `art_vllm_plugin.stage_progress`). The directory is
removed when the update ends.

The API server and the workers of its local engines share this directory. An engine on
another host (multi-node data parallelism) gets the bytes in its stage call and writes its own
stage there with these same functions (`engine_core/relayed_stages.py`).

A budget, because `/dev/shm` is small in containers (64 MiB by default in Docker and
Kubernetes): before anything is written, an adapter over `--art-max-adapter-bytes` is refused
(413, `AdapterTooLarge`) and one that does not fit the free space of the staging directory is
refused (507, `StagingFull`), both naming the numbers; the slot keeps its version. On a
memory-backed directory (tmpfs: `/dev/shm`) the free space is also bounded by the memory
cgroup's limit less its usage (`tmpfs_room`): a container's `/dev/shm` pages count against
its memory limit, and a stage over it would have the kernel end the server mid-update.
`--art-staging-dir DIR` (default `ART_STAGING_DIR`, then `/dev/shm`) picks another directory.

Names, because several servers may share one directory: a stage is
`art-stage-<owner>-<slot>-<version>-<random>`, where `<owner>` is `<pid>.<start>.<pidns>`: the
API server's pid, its start time (clock ticks since boot, `/proc/<pid>/stat`) and its PID
namespace. Two servers never collide, and a server that starts removes the stages it can prove
were left by a process that is gone (`sweep`): only directories with our prefix, owned by our
uid, from our PID namespace, whose pid no longer runs (or runs a process started at another
time). A stage of a live server, of another user or of another container is left alone.
A full-weight stage also records the id of the server that wrote it (`mark_base`: engine 0's
`server_id`, the same for all of one server's API servers), and a server removes only its own
superseded ones (`remove_superseded_base`): another server's current stage is its undo source.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import shutil
import stat
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from art_vllm_plugin.tmpfs_room import HostPaths, room

logger = logging.getLogger("vllm.art_plugin.staging")

READY = "ready"
FAILED = "failed"
DEFAULT_SHM = Path("/dev/shm")
#: Documented default of `--art-staging-dir` (the flag wins when both are given).
ENV_DIR = "ART_STAGING_DIR"
#: Every stage directory's name starts with this (see the module docstring).
PREFIX = "art-stage-"
#: `--art-max-adapter-bytes` when not given: the two files of one adapter together.
DEFAULT_MAX_ADAPTER_BYTES = 4 * 1024**3
#: What a stage needs beyond its files' bytes: the directory, one marker directory per engine
#: and one marker file per worker (a page each on tmpfs).
STAGE_OVERHEAD_BYTES = 64 * 1024
#: Where the /proc facts of a process are read (module level so tests can point it elsewhere).
PROC = Path("/proc")


class StagingDirError(ValueError):
    """The configured staging directory is unusable (the server refuses to start)."""


class StagingRefused(Exception):
    """An adapter was refused before anything was staged; `status` is the HTTP status."""

    status = 500


class AdapterTooLarge(StagingRefused):
    """The adapter is over `--art-max-adapter-bytes`."""

    status = 413


class StagingFull(StagingRefused):
    """The staging directory has not enough free space for the adapter."""

    status = 507


def parse_bytes(value: str) -> int:
    """`4294967296`, `4GiB`, `512MiB`, `64KiB` (also `G`, `M`, `K`): a positive byte count."""
    text = str(value).strip()
    units = {"gib": 1024**3, "g": 1024**3, "mib": 1024**2, "m": 1024**2, "kib": 1024, "k": 1024}
    scale = 1
    for suffix, factor in units.items():
        if text.lower().endswith(suffix):
            text, scale = text[: -len(suffix)].strip(), factor
            break
    try:
        count = int(text) * scale
    except ValueError:
        count = 0
    if count <= 0:
        raise ValueError(
            f"expected a positive number of bytes (e.g. 4294967296, 4GiB, 512MiB), got {value!r}"
        )
    return count


def check_dir(path: str | Path, source: str) -> Path:
    """`path` if it is a directory this process may create stages in, else `StagingDirError`
    naming `source` (the flag or variable it came from)."""
    path = Path(path)
    if not path.is_dir():
        raise StagingDirError(f"{source} {path}: not an existing directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise StagingDirError(f"{source} {path}: not writable by uid {os.getuid()}")
    return path


@dataclass(frozen=True)
class StagingConfig:
    """Where staging directories are created, and the largest adapter accepted."""

    root: Path
    max_adapter_bytes: int = DEFAULT_MAX_ADAPTER_BYTES
    #: Where the memory cgroup and the mounts are read (`tmpfs_room`; tests pass fixtures).
    host: HostPaths = field(default_factory=HostPaths)

    @classmethod
    def default(cls) -> StagingConfig:
        env = os.environ.get(ENV_DIR)
        if env:
            return cls(Path(env))
        if DEFAULT_SHM.is_dir() and os.access(DEFAULT_SHM, os.W_OK):
            return cls(DEFAULT_SHM)
        return cls(Path(tempfile.gettempdir()))

    @classmethod
    def create(cls, staging_dir: str | None, max_adapter_bytes: int | None) -> StagingConfig:
        """From the server's flags: `--art-staging-dir` if given, else `ART_STAGING_DIR`, else
        `/dev/shm` (or the temp directory where there is none); the directory must exist."""
        if staging_dir:
            root = check_dir(staging_dir, "--art-staging-dir")
        elif os.environ.get(ENV_DIR):
            root = check_dir(os.environ[ENV_DIR], ENV_DIR)
        else:
            root = cls.default().root
        return cls(root, max_adapter_bytes or DEFAULT_MAX_ADAPTER_BYTES)

    def check_size(self, sizes: dict[str, int], what: str) -> int:
        """The adapter's total bytes, or `AdapterTooLarge` naming the limit."""
        total = sum(sizes.values())
        if total > self.max_adapter_bytes:
            parts = " + ".join(f"{name} {n}" for name, n in sizes.items())
            raise AdapterTooLarge(
                f"{what} is {total} bytes ({parts}), over this server's limit of "
                f"{self.max_adapter_bytes} bytes (--art-max-adapter-bytes); nothing was staged"
            )
        return total

    def check_space(self, adapter_bytes: int, what: str) -> None:
        """`StagingFull` unless the staging directory has room for a stage of `adapter_bytes`."""
        needed = adapter_bytes + STAGE_OVERHEAD_BYTES
        free, bound = room(self.root, free_bytes(self.root), self.host)
        if needed > free:
            because = f" ({bound})" if bound else ""
            raise StagingFull(
                f"staging {what} needs {needed} bytes in {self.root} ({adapter_bytes} for the "
                f"files, {STAGE_OVERHEAD_BYTES} for markers) but only {free} bytes are "
                f"free{because}; nothing was staged (free space there, or start the server "
                "with --art-staging-dir on a larger file system)"
            )

    def refusal_for(self, exc: OSError, what: str) -> StagingRefused:
        """A write into a stage failed: 507 when the file system is full, else 500."""
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        kind = StagingFull if full else StagingRefused
        detail = "the file system is full" if full else "the write failed"
        return kind(
            f"staging {what} in {self.root} failed: {detail} ({exc}; {free_bytes(self.root)} "
            "bytes free now); nothing was staged"
        )


def free_bytes(root: str | Path) -> int:
    """Bytes this (unprivileged) process may still write below `root`."""
    st = os.statvfs(root)
    return st.f_bavail * st.f_frsize


@functools.cache
def _pid_namespace() -> int:
    try:
        return os.stat(PROC / "self" / "ns" / "pid").st_ino
    except OSError:
        return 0


def _start_time(pid: int) -> int:
    """Process `pid`'s start time in clock ticks since boot (0 when unknown)."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
        return int(text.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


@functools.cache
def _owner_of(pid: int) -> str:
    return f"{pid}.{_start_time(pid)}.{_pid_namespace()}"


def owner_tag() -> str:
    """This process's part of every name it gives a stage: `<pid>.<start>.<pidns>`."""
    return _owner_of(os.getpid())


@dataclass(frozen=True)
class Owner:
    """The process a stage's name says made it (older names carry only the pid)."""

    pid: int
    start: int = 0
    namespace: int = 0

    @classmethod
    def parse(cls, name: str, prefix: str = PREFIX) -> Owner | None:
        if not name.startswith(prefix):
            return None
        fields = name[len(prefix) :].split("-", 1)[0].split(".")
        try:
            numbers = [int(f) for f in fields]
        except ValueError:
            return None
        if not 1 <= len(numbers) <= 3 or numbers[0] <= 0:
            return None
        return cls(*numbers)

    def ours_to_judge(self) -> bool:
        """A pid means something only in the PID namespace it was read in."""
        return self.namespace in (0, _pid_namespace())

    def alive(self) -> bool:
        if self.pid == os.getpid():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # runs, as another user
        started = _start_time(self.pid)
        return not (self.start and started and started != self.start)  # else: pid reused


def new_stage_dir(config: StagingConfig, slot: str, version: int) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in slot)
    path = config.root / f"{PREFIX}{owner_tag()}-{safe}-{version}-{uuid.uuid4().hex[:8]}"
    path.mkdir(mode=0o700)
    return path


def fill_stage(
    config: StagingConfig,
    slot: str,
    version: int,
    engines: list[int],
    write,
    what: str,
    stage_dir: Path | None = None,
) -> Path:
    """A stage directory (a new one, or `stage_dir` that already holds the files) with
    `write(stage_dir)` done and one marker directory per DP engine rank in `engines`. Nothing
    is left behind when it fails: `StagingRefused` (507 when out of space, else 500) for a
    failed write, any other error as raised."""
    try:
        if stage_dir is None:
            stage_dir = new_stage_dir(config, slot, version)
            write(stage_dir)
        for rank in engines:
            marker_dir(stage_dir, rank)
    except OSError as exc:
        if stage_dir is not None:
            remove(stage_dir)
        raise config.refusal_for(exc, what) from exc
    except BaseException:
        if stage_dir is not None:
            remove(stage_dir)
        raise
    return stage_dir


def _entries(root: str | Path, what: str) -> list[os.DirEntry]:
    """The entries of `root`, or none (with a warning naming `what` is left) if it cannot be
    listed: removing leftovers never fails the caller."""
    try:
        return list(os.scandir(root))
    except OSError as exc:
        logger.warning("art: cannot list %s to remove %s: %s", root, what, exc)
        return []


def sweep(root: str | Path, prefix: str = PREFIX) -> list[Path]:
    """Remove what crashed processes left in `root`: entries named `prefix<owner>-...`, owned
    by this uid, from this PID namespace, whose owner process is gone. Returns them."""
    root = Path(root)
    uid = os.getuid()
    removed = []
    for entry in _entries(root, "stale stages"):
        owner = Owner.parse(entry.name, prefix)
        if owner is None or not owner.ours_to_judge() or owner.alive():
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid != uid or not stat.S_ISDIR(st.st_mode):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        if not os.path.lexists(entry.path):
            removed.append(Path(entry.path))
    if removed:
        logger.warning(
            "art: removed %d staging director%s left by processes that are gone: %s",
            len(removed),
            "y" if len(removed) == 1 else "ies",
            ", ".join(str(p) for p in removed),
        )
    return removed


def marker_dir(stage_dir: str | Path, engine: int) -> Path:
    """Where DP engine `engine`'s workers leave their markers: every engine numbers its workers
    from 0, so each engine gets a directory of its own inside the stage directory."""
    path = Path(stage_dir) / marker_dir_name(engine)
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def marker_dir_name(engine: int) -> str:
    """The name of DP engine `engine`'s marker directory inside a stage (`marker_dir` makes it)."""
    return f"markers-engine{engine}"


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


#: In a full-weight stage: the base version it holds (`remove_superseded_base` reads it).
BASE_MARK = ".art-base-version"
#: In a full-weight stage: the id of the server (every API server of one `vllm serve`) that
#: wrote it (`slot_registry.SlotRegistry.server_id`, engine 0's).
SERVER_MARK = ".art-base-server"


def mark_base(stage_dir: Path, version: int, server: str) -> None:
    """Record which server's stage this is and the version it holds (the server first: a
    stage that names a version always names its server)."""
    (stage_dir / SERVER_MARK).write_text(server)
    (stage_dir / BASE_MARK).write_text(str(version))


def remove_superseded_base(root: str | Path, version: int, server: str) -> list[Path]:
    """Remove every full-weight stage in `root` written by `server` (any of its API servers)
    that holds a base version older than `version`; returns them.

    Only `server`'s: two servers on one host share `/dev/shm` by default, and another
    server's stage of its current version is what a revert of its next update reads. A stage
    that names no server (or another) is left alone."""
    removed = []
    for entry in _entries(root, "superseded stages"):
        if not entry.name.startswith(PREFIX):
            continue
        stage = Path(entry.path)
        try:
            owner = (stage / SERVER_MARK).read_text()
            held = int((stage / BASE_MARK).read_text())
        except (OSError, ValueError):
            continue  # no full-weight stage, one being written, or one of an older plugin
        if owner == server and held < version:
            remove(stage)
            removed.append(stage)
    return removed


def ready_text(stage_dir: str | Path, rank: int) -> str:
    """What worker `rank` wrote in its ready marker (a streamed stage: the digest received)."""
    return (Path(stage_dir) / f"{READY}.{rank}").read_text(errors="replace")


def remove(stage_dir: str | Path) -> None:
    shutil.rmtree(stage_dir, ignore_errors=True)
