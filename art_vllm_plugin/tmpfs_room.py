"""Room on a memory-backed staging directory: a tmpfs's pages count against the memory cgroup.

Why: `/dev/shm` in a container is a tmpfs, and every page written there is charged to the
memory cgroup of the process that wrote it. `statvfs` reports the tmpfs's own size (often
half the host's memory, or a `--shm-size` far above the container's limit), not what the
container may still use: a stage that "fits" by `statvfs` can push the container over its
memory limit, and the kernel's OOM killer then ends the server (or the engine) mid-update.
So on a tmpfs the room is also bounded by the cgroup's limit minus its usage, at every level
of the process's cgroup path (a limit on a parent bounds the children too).

Usage is the kernel's `memory.current` (v2) / `memory.usage_in_bytes` (v1) less the inactive
file cache (`inactive_file` / `total_inactive_file` of `memory.stat`), which the kernel
reclaims before it goes out of memory: the "working set" Docker and Kubernetes report.
Shared memory is never in that cache (tmpfs pages are `shmem`, not reclaimable without swap).

The paths read are fields of `HostPaths` (default: this process's), so tests hand in a fake
cgroup directory instead of patching the world, as `art_megatron_ext/cpu_topology.py` does
for CPU quotas. Anything unreadable means "no limit known": the check then falls back to the
file system's own free space, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: cgroup v1 reports "no limit" as a page-rounded LONG_MAX; anything this large is unlimited.
V1_UNLIMITED = 1 << 62
#: File system types whose pages are memory, charged to the writer's memory cgroup.
MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "shmfs", "ramfs"})


@dataclass(frozen=True)
class HostPaths:
    """Where this process's cgroup and mounts are read from (tests point them at fixtures)."""

    cgroup_root: Path = Path("/sys/fs/cgroup")
    self_cgroup: Path = Path("/proc/self/cgroup")
    mountinfo: Path = Path("/proc/self/mountinfo")


@dataclass(frozen=True)
class CgroupRoom:
    """The tightest memory cgroup level: its limit, its usage (working set) and where read."""

    limit: int
    usage: int
    where: Path

    @property
    def free(self) -> int:
        return max(0, self.limit - self.usage)

    def describe(self) -> str:
        return (
            f"the memory cgroup {self.where} allows {self.limit} bytes and uses {self.usage} "
            "(a tmpfs's pages count against that limit)"
        )


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (`\\040`)."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def fs_type(path: str | Path, mountinfo: Path) -> str | None:
    """The file system type of the mount holding `path` (the longest mount point above its
    resolved form), or None when mountinfo cannot be read."""
    target = Path(path).resolve()
    best: tuple[int, str] | None = None
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        point = Path(_unescape(fields[4]))
        if (point == target or point in target.parents) and (
            best is None or len(point.parts) >= best[0]
        ):
            best = (len(point.parts), right.split()[0])  # later mounts shadow earlier ones
    return best[1] if best else None


def is_memory_backed(path: str | Path, host: HostPaths) -> bool:
    return fs_type(path, host.mountinfo) in MEMORY_FILE_SYSTEMS


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    try:
        return int(text)
    except ValueError:
        return None  # "max" (v2 unlimited) or garbage


def _stat_field(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_paths(self_cgroup: Path) -> tuple[str | None, str | None]:
    """(the v2 path, the v1 memory controller's path) of this process, from /proc/self/cgroup
    (`0::/path` for v2, `N:...memory...:/path` for v1)."""
    v2 = v1 = None
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _levels(mount: Path, cgroup_path: str | None) -> list[Path]:
    """The directories from the process's cgroup up to the hierarchy's root, those that exist
    (inside a cgroup namespace the path is `/` and the mount is the process's own cgroup)."""
    if cgroup_path is None:
        return []
    levels, here = [], mount / cgroup_path.lstrip("/")
    while True:
        if here.is_dir():
            levels.append(here)
        if here == mount or mount not in here.parents:
            break
        here = here.parent
    return levels


def _level_room(level: Path, limit_file: str, usage_file: str, inactive_key: str, unlimited):
    limit = _read_int(level / limit_file)
    usage = _read_int(level / usage_file)
    if limit is None or usage is None or unlimited(limit):
        return None
    working = max(0, usage - _stat_field(level / "memory.stat", inactive_key))
    return CgroupRoom(limit, working, level / limit_file)


def cgroup_room(host: HostPaths = HostPaths()) -> CgroupRoom | None:
    """The tightest memory limit over this process's cgroup levels (v2 `memory.max` /
    `memory.current`, v1 `memory.limit_in_bytes` / `memory.usage_in_bytes`), or None when no
    level has one."""
    v2_path, v1_path = _cgroup_paths(host.self_cgroup)
    rooms = [
        _level_room(level, "memory.max", "memory.current", "inactive_file", lambda n: False)
        for level in _levels(host.cgroup_root, v2_path)
    ]
    rooms += [
        _level_room(
            level,
            "memory.limit_in_bytes",
            "memory.usage_in_bytes",
            "total_inactive_file",
            lambda n: n >= V1_UNLIMITED,
        )
        for level in _levels(host.cgroup_root / "memory", v1_path)
    ]
    known = [r for r in rooms if r is not None]
    return min(known, key=lambda r: r.free) if known else None


def room(path: str | Path, fs_free: int, host: HostPaths = HostPaths()) -> tuple[int, str | None]:
    """(bytes a stage may take below `path`, why it is less than `fs_free` or None): on a
    memory-backed file system the cgroup's room bounds the file system's free space."""
    if not is_memory_backed(path, host):
        return fs_free, None
    limited = cgroup_room(host)
    if limited is None or limited.free >= fs_free:
        return fs_free, None
    return limited.free, limited.describe()
