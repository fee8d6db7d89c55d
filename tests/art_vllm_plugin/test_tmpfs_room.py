"""The staging budget on a memory-backed directory counts the memory cgroup (`tmpfs_room`).

A container's `/dev/shm` is a tmpfs whose pages are charged to the container's memory cgroup:
a stage that fits the tmpfs's own free space can still push the container over its memory
limit (before, only `statvfs` was read). Each test builds a fake cgroup tree and mountinfo
and hands them in (`HostPaths`), as a container would show them; no server.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from art_vllm_plugin import staging
from art_vllm_plugin.tmpfs_room import HostPaths, cgroup_room, fs_type, room

GIB = 1024**3


def _host(tmp_path: Path, staging_fs: str, cgroup_lines: list[str]) -> HostPaths:
    """Fake /proc/self/mountinfo (the staging directory `tmp_path/shm` on `staging_fs`, the
    rest on ext4) and /proc/self/cgroup; the cgroup tree is `tmp_path/cgroup`."""
    shm = tmp_path / "shm"
    shm.mkdir(parents=True, exist_ok=True)
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n"
        f"25 22 0:23 / {shm} rw,nosuid,nodev - {staging_fs} shm rw,size=65536k\n"
    )
    self_cgroup = tmp_path / "self-cgroup"
    self_cgroup.write_text("".join(line + "\n" for line in cgroup_lines))
    return HostPaths(cgroup_root=tmp_path / "cgroup", self_cgroup=self_cgroup, mountinfo=mountinfo)


def _v2_level(path: Path, limit: str, current: int, inactive_file: int = 0) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "memory.max").write_text(limit + "\n")
    (path / "memory.current").write_text(f"{current}\n")
    (path / "memory.stat").write_text(f"anon 1\nfile 9\ninactive_file {inactive_file}\nshmem 3\n")


def _v1_level(path: Path, limit: int, usage: int, inactive_file: int = 0) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (path / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (path / "memory.stat").write_text(f"cache 5\ntotal_inactive_file {inactive_file}\n")


def test_a_v2_limit_bounds_a_tmpfs_stage_and_the_refusal_names_it(tmp_path):
    """cgroup v2 in a cgroup namespace (`0::/`): 1 GiB allowed, 0.9 GiB in use, of which
    50 MiB inactive file cache (reclaimable): room 1 GiB - (0.9 GiB - 50 MiB)."""
    host = _host(tmp_path, "tmpfs", ["0::/"])
    used, cache = int(0.9 * GIB), 50 * 1024**2
    _v2_level(tmp_path / "cgroup", str(GIB), used, cache)
    limited = cgroup_room(host)
    assert limited is not None
    assert (limited.limit, limited.usage) == (GIB, used - cache)
    free = GIB - (used - cache)
    config = staging.StagingConfig(tmp_path / "shm", host=host)
    with pytest.raises(staging.StagingFull) as err:
        config.check_space(free, "the full weights at /ckpt")  # plus the markers: too much
    message = str(err.value)
    assert f"only {free} bytes are free" in message
    assert f"the memory cgroup {tmp_path / 'cgroup' / 'memory.max'} allows {GIB}" in message
    config.check_space(free - staging.STAGE_OVERHEAD_BYTES, "a stage that fits")


def test_the_tightest_level_of_the_path_counts(tmp_path):
    """A limit on a parent bounds its children (here the parent's is the tighter one)."""
    host = _host(tmp_path, "tmpfs", ["0::/pod/ctr"])
    _v2_level(tmp_path / "cgroup" / "pod", str(2 * GIB), int(1.8 * GIB))
    _v2_level(tmp_path / "cgroup" / "pod" / "ctr", "max", int(1.8 * GIB))
    limited = cgroup_room(host)
    assert limited is not None and limited.where == tmp_path / "cgroup" / "pod" / "memory.max"
    assert limited.free == 2 * GIB - int(1.8 * GIB)


def test_v1_limits_are_read_and_the_unlimited_value_ignored(tmp_path):
    host = _host(tmp_path, "tmpfs", ["5:memory:/docker/abc", "4:cpu,cpuacct:/docker/abc"])
    _v1_level(tmp_path / "cgroup" / "memory", 9223372036854771712, 10 * GIB)  # the host: none
    _v1_level(tmp_path / "cgroup" / "memory" / "docker" / "abc", GIB, GIB // 2, GIB // 8)
    limited = cgroup_room(host)
    assert limited is not None
    assert (limited.limit, limited.usage) == (GIB, GIB // 2 - GIB // 8)
    assert room(tmp_path / "shm", 10 * GIB, host) == (limited.free, limited.describe())


def test_no_limit_or_no_tmpfs_leaves_the_file_systems_free_space(tmp_path):
    """Unlimited (`max`), unreadable, or a staging directory on disk: the file system's own
    free space is the room, as before."""
    host = _host(tmp_path, "tmpfs", ["0::/"])
    _v2_level(tmp_path / "cgroup", "max", 5 * GIB)
    assert cgroup_room(host) is None
    assert room(tmp_path / "shm", 123, host) == (123, None)
    on_disk = _host(tmp_path / "disk", "ext4", ["0::/"])
    _v2_level(tmp_path / "disk" / "cgroup", str(GIB), GIB - 10)
    assert room(tmp_path / "disk" / "shm", 10**6, on_disk) == (10**6, None)
    nothing = HostPaths(tmp_path / "none", tmp_path / "none", tmp_path / "none")
    assert cgroup_room(nothing) is None and room(tmp_path, 7, nothing) == (7, None)


def test_fs_type_takes_the_deepest_mount_and_unescapes_spaces(tmp_path):
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
        "30 22 0:40 / /data/my\\040shm rw - tmpfs tmpfs rw\n"
        "31 30 8:2 / /data/my\\040shm/disk rw - xfs /dev/sdb rw\n"
    )
    assert fs_type("/data/my shm/x", mountinfo) == "tmpfs"
    assert fs_type("/data/my shm/disk/y", mountinfo) == "xfs"
    assert fs_type("/etc", mountinfo) == "ext4"
    assert fs_type("/etc", tmp_path / "missing") is None
