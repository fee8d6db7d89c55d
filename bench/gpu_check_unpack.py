"""Unpack the compressed GPU carry (`make gpu-carry`) on the device, before the preflight.

Why: the carry travels compressed (the working tree and the carry together must stay under
64 MiB), so `bench/gpu_check.sh` unpacks it into a scratch directory first. Standard library
only (`tarfile` reads xz and gzip itself): the device image may have no `xz` binary.

Carried archives, each optional (`scripts/gpu_carry.sh` writes them):
  megatron-core.tar.xz  `megatron/` (+ its dist-info), unpacked to DEST/site -> PYTHONPATH
  cutlass.tar.xz        `cutlass/include`, `cutlass/tools/util/include`  -> ART_CUTLASS_DIR

Usage: python bench/gpu_check_unpack.py CARRY_DIR DEST
  stdout: `export NAME=value` lines, for `eval` (also written to DEST/env.sh);
  stderr: what was unpacked, how long it took, and what is missing.
Exit 0 if at least one archive was unpacked, 1 if none was usable, 2 on bad arguments.
A missing or broken archive is reported and leaves that variable unset (what the check then
does without it is the preflight's and the tests' business: they say so).
"""

from __future__ import annotations

import shlex
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Part:
    """One carried archive: where it unpacks inside DEST and what it exports."""

    archive: str  # file name inside the carry dir (.tar.xz, or .tar.gz beside it)
    subdir: str  # unpacked under DEST/<subdir>
    marker: str  # a path inside DEST/<subdir> that must exist afterwards
    env: str  # variable exported
    value: str  # path inside DEST/<subdir> the variable points at ("" = the subdir)
    prepend: bool  # prepend to the variable's current value (a search path)


PARTS = (
    Part("megatron-core.tar.xz", "site", "megatron/core/__init__.py", "PYTHONPATH", "", True),
    Part("cutlass.tar.xz", "", "cutlass/include/cutlass/version.h", "ART_CUTLASS_DIR",
         "cutlass", False),
)  # fmt: skip


def _find(carry: Path, name: str) -> Path | None:
    for candidate in (name, name.removesuffix(".xz") + ".gz"):
        if (carry / candidate).is_file():
            return carry / candidate
    return None


def _extract(archive: Path, dest: Path) -> None:
    with tarfile.open(archive) as tar:  # compression detected from the content
        try:
            tar.extractall(dest, filter="data")  # refuses absolute paths, links out, devices
        except TypeError:  # Python without extraction filters (< 3.11.4)
            tar.extractall(dest)


def unpack(carry: Path, dest: Path, log=sys.stderr) -> dict[str, str]:
    """Unpack every carried archive found; return {variable: value} for those that worked."""
    env: dict[str, str] = {}
    for part in PARTS:
        archive = _find(carry, part.archive)
        if archive is None:
            print(f"[unpack] {part.archive}: not in {carry}; {part.env} not set", file=log)
            continue
        root = dest / part.subdir if part.subdir else dest
        t0 = time.monotonic()
        try:
            _extract(archive, root)
        except (OSError, tarfile.TarError, EOFError) as exc:
            print(f"[unpack] {archive}: unreadable ({exc}); {part.env} not set", file=log)
            continue
        if not (root / part.marker).exists():
            print(f"[unpack] {archive}: no {part.marker} inside; {part.env} not set", file=log)
            continue
        value = str((root / part.value) if part.value else root)
        env[part.env] = value
        mib = archive.stat().st_size / 2**20
        print(f"[unpack] {archive.name} ({mib:.1f} MiB) -> {value} in "
              f"{time.monotonic() - t0:.1f} s", file=log)  # fmt: skip
    return env


def export_lines(env: dict[str, str]) -> list[str]:
    lines = []
    for part in PARTS:
        if part.env not in env:
            continue
        value = shlex.quote(env[part.env])
        if part.prepend:
            lines.append(f'export {part.env}={value}"${{{part.env}:+:${part.env}}}"')
        else:
            lines.append(f"export {part.env}={value}")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python bench/gpu_check_unpack.py CARRY_DIR DEST", file=sys.stderr)
        return 2
    carry, dest = Path(argv[0]), Path(argv[1]).resolve()
    if not carry.is_dir():
        print(f"[unpack] carry dir {carry} not found (run `make gpu-carry`)", file=sys.stderr)
        return 1
    dest.mkdir(parents=True, exist_ok=True)
    lines = export_lines(unpack(carry, dest))
    (dest / "env.sh").write_text("".join(line + "\n" for line in lines))
    print("\n".join(lines))
    if not lines:
        print(f"[unpack] nothing usable in {carry}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
