"""How busy the host's CPUs were over a run: `start FILE` records /proc/stat's totals, `report
FILE` prints the busy share since then.

Why: `make test` runs three lanes on a 2-core host, and whether they are bound by CPU (then
only less work helps) or by waiting (then more lanes or less waiting help) decides how to cut
its time. `time make test` cannot tell: it counts only the CPU of processes it reaped.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def _totals() -> tuple[int, int]:
    """(busy, all) jiffies over every CPU since boot; idle and iowait count as not busy."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] not in ("start", "report"):
        print(f"usage: {argv[0]} start|report FILE", file=sys.stderr)
        return 2
    path = Path(argv[2])
    busy, total = _totals()
    if argv[1] == "start":
        path.write_text(f"{busy} {total}\n")
        return 0
    if not path.exists():
        print(f"[test] host CPU: no start record at {path}")
        return 0
    busy0, total0 = (int(x) for x in path.read_text().split())
    share = (busy - busy0) / max(1, total - total0)
    print(f"[test] host CPU busy {100 * share:.0f}% of {os.cpu_count()} cores over the run")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
