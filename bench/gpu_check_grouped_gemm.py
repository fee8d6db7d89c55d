"""Timing stage of bench/gpu_check.sh for the CUTLASS grouped GEMM (one sm_90 GPU).

For 30B-A3B-class expert shapes (128 experts, fc1 2048 -> 1536, fc2 768 -> 2048, 65536 routed
rows), with uniform routing and with skewed (Zipf) routing that leaves experts empty, times
forward, dgrad and wgrad of our kernels against `torch._grouped_mm` on the same preallocated
inputs, and against the measured dense bf16 matmul ceiling. One verdict per (op, routing),
the worst of the two layers: PASS needs >= 1.10x torch._grouped_mm AND >= 60% of the ceiling,
and outputs within bf16 tolerance of torch's (a fast wrong kernel must not pass).

    python bench/gpu_check_grouped_gemm.py --verdicts V.tsv --report R.md
    python bench/gpu_check_grouped_gemm.py --dry-run     # CPU: the same code on tiny shapes
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from gpu_check_common import matmul_ceiling_flops, record_verdicts, time_per_call
from grouped_gemm import skewed_counts

SPEEDUP_TARGET = 1.10
CEILING_TARGET = 0.60
LAYERS = (("fc1", 2048, 1536), ("fc2", 768, 2048))
OPS = ("fwd", "dgrad", "wgrad")
ROUTINGS = ("uniform", "skewed")
CHECKS = [f"grouped GEMM {op} ({routing})" for routing in ROUTINGS for op in OPS]


def _counts(routing: str, rows: int, groups: int) -> list[int]:
    if routing == "uniform":
        return [rows // groups] * groups
    counts = skewed_counts(rows, groups, seed=rows + groups)
    for small in sorted(range(groups), key=counts.__getitem__)[: max(1, groups // 8)]:
        counts[max(range(groups), key=counts.__getitem__)] += counts[small]
        counts[small] = 0  # at least 1 in 8 experts empty, whatever the draw
    return counts


def _ops(x, w, dy, ends, ours_lib, dry: bool):
    """{op: (ours, torch)} callables over preallocated tensors."""
    wt = w.transpose(1, 2)
    theirs = {
        "fwd": lambda: torch._grouped_mm(x, w, offs=ends),
        "dgrad": lambda: torch._grouped_mm(dy, wt, offs=ends),
        "wgrad": lambda: torch._grouped_mm(x.t(), dy, offs=ends),
    }
    if dry:  # no GPU: the harness is exercised with torch on both sides
        return {op: (fn, fn) for op, fn in theirs.items()}
    from art_megatron_ext.ops import cutlass_grouped_gemm as cg

    ours = {
        "fwd": lambda: cg.fwd(x, w, ends, lib=ours_lib),
        "dgrad": lambda: cg.dgrad(dy, w, ends, lib=ours_lib),
        "wgrad": lambda: cg.wgrad(x, dy, ends, lib=ours_lib),
    }
    return {op: (ours[op], theirs[op]) for op in OPS}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run(dry: bool, verdicts: Path | None, report: Path | None, iters: int) -> int:
    device, dtype = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
    rows, groups = (256, 4) if dry else (65536, 128)
    layers = (("fc1", 64, 32), ("fc2", 32, 64)) if dry else LAYERS
    lib = None
    if not dry:
        from art_megatron_ext.ops import cutlass_grouped_gemm as cg

        lib = cg.load_library()
    ceiling = 1.0 if dry else matmul_ceiling_flops()
    lines = [
        f"dense bf16 ceiling (torch.mm 8192^3, random data): {ceiling / 1e12:.0f} TFLOP/s",
        "",
        "| layer | routing | op | ours TFLOP/s | torch TFLOP/s | vs torch | vs ceiling | rel err |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    worst: dict[str, tuple[float, float, float]] = {}
    gen = torch.Generator().manual_seed(0)
    for routing in ROUTINGS:
        counts = _counts(routing, rows, groups)
        ends = torch.tensor(counts).cumsum(0).to(torch.int32).to(device)
        for layer, k, n in layers:
            x = torch.randn(rows, k, generator=gen).to(device, dtype)
            w = (torch.randn(groups, k, n, generator=gen) / k**0.5).to(device, dtype)
            dy = torch.randn(rows, n, generator=gen).to(device, dtype)
            flops = 2.0 * rows * k * n
            for op, (ours, theirs) in _ops(x, w, dy, ends, lib, dry).items():
                err = _rel_err(ours(), theirs())
                t_ours = time_per_call(ours, iters, cuda=not dry)
                t_theirs = time_per_call(theirs, iters, cuda=not dry)
                speedup, frac = t_theirs / t_ours, flops / t_ours / ceiling
                lines.append(
                    f"| {layer} | {routing} | {op} | {flops / t_ours / 1e12:.1f} | "
                    f"{flops / t_theirs / 1e12:.1f} | {speedup:.2f}x | {frac:.0%} | {err:.1e} |"
                )
                key = f"grouped GEMM {op} ({routing})"
                prev = worst.get(key, (float("inf"), float("inf"), 0.0))
                worst[key] = (min(prev[0], speedup), min(prev[1], frac), max(prev[2], err))
    text = "\n".join(lines)
    print(text, flush=True)
    if report is not None:
        report.write_text(text + "\n")
    target = f">={SPEEDUP_TARGET:.2f}x torch._grouped_mm, >={CEILING_TARGET:.0%} of ceiling"
    rows = []
    for check in CHECKS:
        speedup, frac, err = worst[check]
        ok = speedup >= SPEEDUP_TARGET and frac >= CEILING_TARGET and err <= 2e-2
        measured = f"{speedup:.2f}x torch, {frac:.0%} of ceiling, rel err {err:.0e}"
        rows.append((check, measured, target, ok))
    return record_verdicts(verdicts, rows, dry)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--verdicts", type=Path)
    parser.add_argument("--report", type=Path)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    return 1 if run(args.dry_run, args.verdicts, args.report, args.iters) else 0


if __name__ == "__main__":
    sys.exit(main())
