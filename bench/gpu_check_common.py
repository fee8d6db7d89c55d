"""Shared pieces of the bench/gpu_check_*.py stages: timing and the verdict rows.

Timing (METHOD.md): inputs are allocated before the clock starts, one CUDA event pair spans
many back-to-back calls (launch gaps amortised, no per-call sync), the median of a few such
spans is kept. In a dry run (CPU) the same code runs with a host clock.

Verdicts: each stage appends `check<TAB>measured<TAB>target<TAB>PASS|FAIL|N/A` lines to the
file named by `--verdicts`; bench/gpu_check.sh prints them as one table and marks every
expected check without a line "not run".
"""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path


def time_per_call(fn: Callable[[], object], iters: int, repeats: int = 3, cuda: bool = True):
    """Median over `repeats` spans of seconds per call of `iters` back-to-back calls."""
    fn()  # warm-up: module load, workspace allocation, first-touch
    if cuda:
        import torch

        torch.cuda.synchronize()
        spans = []
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            spans.append(start.elapsed_time(end) / 1e3 / iters)
        return statistics.median(spans)
    spans = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        spans.append((time.perf_counter() - t0) / iters)
    return statistics.median(spans)


def copy_ceiling_bytes_per_s(nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    import torch

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    secs = time_per_call(lambda: dst.copy_(src), iters)
    return 2 * nbytes / secs


def matmul_ceiling_flops(n: int = 8192, iters: int = 10) -> float:
    """Dense bf16 matmul rate on random data (torch.mm n^3), in FLOP/s."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / time_per_call(lambda: torch.mm(a, b), iters)


_WRITTEN: set[str] = set()
"""The checks this process has written a row for (`fail_unwritten` fills in the others)."""


def write_verdict(path: Path | None, check: str, measured: str, target: str, ok: bool | None):
    """Append one verdict row (ok None = N/A) and echo it to the log."""
    _WRITTEN.add(check)
    verdict = "N/A" if ok is None else ("PASS" if ok else "FAIL")
    line = f"{check}\t{measured}\t{target}\t{verdict}"
    print(f"verdict: {line}", flush=True)
    if path is not None:
        with open(path, "a") as f:
            f.write(line + "\n")


def record_verdicts(path: Path | None, rows, dry: bool) -> int:
    """Write `rows` of (check, measured, target, ok) as verdicts; on a dry run only say what
    would be recorded. Returns the number of failed checks."""
    failed = 0
    for check, measured, target, ok in rows:
        if dry:
            print(f"dry run: would record {check!r}: {target}", flush=True)
            continue
        write_verdict(path, check, measured, target, ok)
        failed += int(not ok)
    return failed


def first_line(exc: BaseException) -> str:
    """`Type: first line of the message`, short enough for a verdict cell."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def run_check(
    path: Path | None,
    check: str,
    target: str,
    measure: Callable[[], tuple[str, bool]],
    dry: bool = False,
) -> bool:
    """Run one check and write its row as soon as it ends.

    `measure()` returns (measured, ok). An exception becomes a FAIL row naming it (the
    traceback goes to the log) and the caller goes on with its next check, so one broken op
    never costs the rows after it. On a dry run `measure` still runs (tiny CPU shapes, so the
    harness is exercised) but no row is written. Returns ok (True on a dry run that did not
    raise)."""
    try:
        measured, ok = measure()
    except Exception as exc:  # every failure must become a row
        traceback.print_exc()
        measured, ok = f"raised {first_line(exc)}", False
    if dry:
        print(f"dry run: {check}: {measured} (target {target}; not recorded)", flush=True)
        return ok
    write_verdict(path, check, measured, target, ok)
    return ok


def fail_unwritten(path: Path | None, checks, exc: BaseException, dry: bool = False) -> int:
    """After `exc` stopped a stage part-way: a FAIL row naming it for each of `checks` that
    has no row yet (so the table says what broke, not "not run"). Returns how many."""
    traceback.print_exception(exc)
    missing = [c for c in checks if c not in _WRITTEN]
    for check in missing:
        if dry:
            print(f"dry run: {check}: raised {first_line(exc)} (not recorded)", flush=True)
        else:
            write_verdict(path, check, f"raised {first_line(exc)}", "", False)
    return len(missing)


def stage_parser(doc: str, iters: int):
    """The arguments every bench/gpu_check_*.py stage takes (`--dry-run`, `--verdicts`,
    `--report`, `--iters`); a stage adds its own."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU: the harness, no rows")
    parser.add_argument("--verdicts", type=Path)
    parser.add_argument("--report", type=Path)
    parser.add_argument("--iters", type=int, default=iters)
    return parser


def guarded(run: Callable[[], int], args, checks) -> int:
    """`run()` (a stage part returning its failed checks); an exception outside any one row
    fails the rows of `checks` not yet written, naming it, instead of leaving them "not run"."""
    try:
        return run()
    except Exception as exc:
        return fail_unwritten(args.verdicts, checks, exc, args.dry_run)


class Memo:
    """Values a stage builds once, on first use, by key (inputs, a library, a ceiling). A
    failure is kept and re-raised for every later use: each row that needs the value fails
    naming why, without paying for the attempt again. `clock` times each build (pass one that
    synchronizes the device to see GPU time)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._values: dict[str, object] = {}

    def get(self, key: str, make: Callable[[], object]):
        if key not in self._values:
            t0 = self._clock()
            try:
                self._values[key] = make()
            except Exception as exc:  # kept: re-raised for every row that needs it
                self._values[key] = exc
            print(f"elapsed: {key}: {self._clock() - t0:.2f} s", flush=True)
        value = self._values[key]
        if isinstance(value, Exception):
            raise value
        return value

    def drop(self, key: str) -> None:
        """Forget `key` (free what it holds before the next value is built)."""
        self._values.pop(key, None)
