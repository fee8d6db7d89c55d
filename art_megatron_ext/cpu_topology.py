"""How many CPUs this process may really use, for sizing worker pools.

Why: `os.cpu_count()` reports the host's CPUs. Inside a container or a Slurm job the
process may be pinned to fewer CPUs (affinity) or throttled by a CFS bandwidth quota
(cgroup v2 `cpu.max`, cgroup v1 `cpu.cfs_quota_us / cpu.cfs_period_us`). A pool sized from
the host count oversubscribes and gets throttled. Usable CPUs are the minimum of the
affinity mask and every quota found, at least 1.

A fractional quota rounds up (1.5 CPUs -> 2), as the JVM and Go runtimes do: two workers
sharing 1.5 CPUs of quota finish more work than one. The paths below are module constants
so tests point them at fixture files; they are read at call time.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CpuBudget", "cpu_budget", "pool_workers", "usable_cpus"]

logger = logging.getLogger(__name__)

PROC_SELF_CGROUP = "/proc/self/cgroup"  # "0::/some/path" names this process's v2 cgroup
CGROUP_V2_ROOT = "/sys/fs/cgroup"  # unified hierarchy; cpu.max in the cgroup and its parents
CGROUP_V1_CFS_QUOTA_US = "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"  # -1 = unlimited
CGROUP_V1_CFS_PERIOD_US = "/sys/fs/cgroup/cpu/cpu.cfs_period_us"


@dataclass(frozen=True)
class CpuBudget:
    """Each source of the CPU limit, and the result (for logs and diagnostics)."""

    affinity: int
    cgroup_v2: float | None  # CPUs of quota; None when unlimited, absent or unreadable
    cgroup_v1: float | None
    usable: int


def _read_text(path: Path) -> str | None:
    """The file's stripped text; None when it is absent. A file that exists but cannot be
    read as text (a directory, bytes that are not UTF-8, an I/O or permission error) is
    reported like malformed content and also gives None: the other limits stay in effect."""
    try:
        return path.read_text(encoding="utf-8").strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, UnicodeDecodeError) as exc:  # IsADirectoryError, PermissionError, EIO...
        _unreadable(path, exc)
        return None


def _unreadable(path: Path, exc: BaseException) -> None:
    logger.warning(
        "ignoring unreadable CPU quota file %s (%s: %s); the other CPU limits stay in effect",
        path,
        type(exc).__name__,
        exc,
    )


def _malformed(path: Path, text: str) -> None:
    logger.warning(
        "ignoring malformed CPU quota file %s (content %r); the other CPU limits stay in effect",
        path,
        text[:80],
    )


def _parse_cpu_max(path: Path) -> float | None:
    text = _read_text(path)
    if text is None:
        return None
    parts = text.split()
    if len(parts) == 2 and parts[0] == "max":
        return None
    try:
        quota, period = (int(x) for x in parts)
    except ValueError:
        _malformed(path, text)
        return None
    if quota <= 0 or period <= 0:
        _malformed(path, text)
        return None
    return quota / period


def _own_v2_cgroup() -> str:
    text = _read_text(Path(PROC_SELF_CGROUP)) or ""
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:]
    return "/"


def cgroup_v2_cpu_limit() -> float | None:
    """Smallest `cpu.max` quota (in CPUs) of this process's cgroup, its parents and the root."""
    root = Path(CGROUP_V2_ROOT)
    limits = []
    directory = root / _own_v2_cgroup().strip("/")
    while True:
        limit = _parse_cpu_max(directory / "cpu.max")
        if limit is not None:
            limits.append(limit)
        if directory == root or root not in directory.parents:
            break
        directory = directory.parent
    if directory != root:  # the cgroup path was outside the mount: fall back to its root
        limit = _parse_cpu_max(root / "cpu.max")
        if limit is not None:
            limits.append(limit)
    return min(limits) if limits else None


def cgroup_v1_cpu_limit() -> float | None:
    """CFS quota / period of cgroup v1 in CPUs; None when unlimited (-1), absent or malformed."""
    quota_path, period_path = Path(CGROUP_V1_CFS_QUOTA_US), Path(CGROUP_V1_CFS_PERIOD_US)
    quota_text, period_text = _read_text(quota_path), _read_text(period_path)
    if quota_text is None or period_text is None:
        return None
    try:
        quota = int(quota_text)
    except ValueError:
        _malformed(quota_path, quota_text)
        return None
    try:
        period = int(period_text)
    except ValueError:
        _malformed(period_path, period_text)
        return None
    if quota == -1:
        return None
    if quota <= 0 or period <= 0:
        _malformed(quota_path, f"{quota_text} / {period_text}")
        return None
    return quota / period


def affinity_cpu_count() -> int:
    """CPUs in this process's affinity mask (the host count where affinity is unsupported)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_budget(*, affinity: int | None = None) -> CpuBudget:
    """Every CPU limit of this process and the usable count (`affinity` overrides the mask)."""
    mask = affinity_cpu_count() if affinity is None else affinity
    if mask < 1:
        raise ValueError(f"affinity must be >= 1 CPU, got {mask}")
    v2, v1 = cgroup_v2_cpu_limit(), cgroup_v1_cpu_limit()
    usable = min([mask] + [math.ceil(q) for q in (v2, v1) if q is not None])
    return CpuBudget(affinity=mask, cgroup_v2=v2, cgroup_v1=v1, usable=max(1, usable))


def usable_cpus(*, affinity: int | None = None) -> int:
    """min(affinity, cgroup v2 quota, cgroup v1 quota), at least 1."""
    return cpu_budget(affinity=affinity).usable


def pool_workers(cap: int | None = None, reserve: int = 0, *, affinity: int | None = None) -> int:
    """Worker count for a pool: usable CPUs minus `reserve`, at most `cap`, at least 1.

    Args:
        cap: upper bound (e.g. the number of work items); None for no bound.
        reserve: CPUs left for the main thread and other pools.
        affinity: override of the affinity mask size (tests, or a planned pinning).
    """
    if cap is not None and cap < 1:
        raise ValueError(f"pool_workers cap must be >= 1 or None, got {cap}")
    if reserve < 0:
        raise ValueError(f"pool_workers reserve must be >= 0, got {reserve}")
    workers = usable_cpus(affinity=affinity) - reserve
    if cap is not None:
        workers = min(workers, cap)
    return max(1, workers)
