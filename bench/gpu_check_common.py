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


def write_verdict(path: Path | None, check: str, measured: str, target: str, ok: bool | None):
    """Append one verdict row (ok None = N/A) and echo it to the log."""
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
