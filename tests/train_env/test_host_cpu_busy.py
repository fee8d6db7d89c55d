"""scripts/host_cpu_busy.py (what `make test` prints at its end): a share from /proc/stat
between its start record and now, and a clear line without one."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "host_cpu_busy.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)


def test_start_then_report_prints_the_busy_share(tmp_path):
    record = tmp_path / "cpu.start"
    assert _run("start", str(record)).returncode == 0
    busy, total = (int(x) for x in record.read_text().split())
    assert 0 <= busy <= total
    sum(range(2_000_000))  # some CPU between the two reads
    out = _run("report", str(record))
    assert out.returncode == 0
    share = re.fullmatch(r"\[test\] host CPU busy (\d+)% of \d+ cores over the run\n", out.stdout)
    assert share is not None, out.stdout
    assert 0 <= int(share.group(1)) <= 100


def test_report_without_a_start_record_says_so(tmp_path):
    out = _run("report", str(tmp_path / "missing"))
    assert out.returncode == 0 and "no start record" in out.stdout


def test_a_wrong_call_is_a_usage_error():
    out = _run("stop", "x")
    assert out.returncode == 2 and "usage" in out.stderr
