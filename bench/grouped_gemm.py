"""Grouped GEMM benchmark: ratios against baselines measured in the same run.

CPU (always): `art_megatron_ext.ops.grouped_gemm` (torch._grouped_mm path) vs a per-expert
matmul loop, forward + backward.
GPU (`--gpu`, an sm_90 GPU): TFLOP/s of forward, dgrad and wgrad of the CUTLASS kernel vs
`torch._grouped_mm` and vs the measured dense bf16 matmul ceiling (torch.mm 8192^3), for
30B-A3B-class MoE shapes (128 experts, hidden 2048, expert FFN 768: fc1 2048 -> 1536 gated,
fc2 768 -> 2048) with 8k-64k routed rows and skewed (Zipf) routing with empty experts.

    python bench/grouped_gemm.py            # CPU table
    python bench/grouped_gemm.py --gpu      # GPU table (about 2 minutes after the build)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from art_megatron_ext.ops import grouped_gemm


def skewed_counts(rows: int, groups: int, seed: int, zipf: float = 1.2) -> list[int]:
    """Zipf-like routing: a few hot experts, a long tail, some experts empty."""
    gen = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, groups + 1, dtype=torch.float64) ** zipf
    weights = weights[torch.randperm(groups, generator=gen)]
    counts = torch.floor(weights / weights.sum() * rows).to(torch.int64)
    counts[counts < 2] = 0  # the tail gets nothing: empty experts are part of the workload
    counts[int(torch.argmax(counts))] += rows - int(counts.sum())
    return counts.tolist()


def _loop(x, w, counts):
    return torch.cat([xs @ w[g] for g, xs in enumerate(torch.split(x, counts))])


def _cpu_time(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _cpu_row(dtype, groups: int, k: int, n: int, rows: int, reps: int) -> str:
    counts = skewed_counts(rows, groups, seed=rows + groups)
    x = torch.randn(rows, k, dtype=dtype, requires_grad=True)
    w = torch.randn(groups, k, n, dtype=dtype, requires_grad=True)
    dy = torch.randn(rows, n, dtype=dtype)
    t_loop = _cpu_time(lambda: _loop(x, w, counts).backward(dy), reps)
    t_op = _cpu_time(lambda: grouped_gemm(x, w, counts, backend="torch").backward(dy), reps)
    name = str(dtype).removeprefix("torch.")
    return (
        f"| {name} | {groups} | {k} | {n} | {rows} | {t_loop * 1e3:.2f} | {t_op * 1e3:.2f} | "
        f"{t_loop / t_op:.2f}x |"
    )


def run_cpu(reps: int) -> None:
    torch.manual_seed(0)
    print("| dtype | experts | K | N | rows | loop fwd+bwd ms | op fwd+bwd ms | speed-up |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for dtype in (torch.float32, torch.bfloat16):
        for groups, k, n, rows in ((8, 256, 512, 4096), (32, 256, 192, 8192), (64, 128, 64, 8192)):
            print(_cpu_row(dtype, groups, k, n, rows, reps))


def _gpu_time(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def bf16_ceiling_tflops(reps: int) -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / _gpu_time(lambda: torch.mm(a, b), reps) / 1e12


def run_gpu(reps: int) -> None:
    from art_megatron_ext.ops import cutlass_grouped_gemm as cg

    lib = cg.load_library()
    ceiling = bf16_ceiling_tflops(reps)
    print(f"measured dense bf16 ceiling (torch.mm 8192^3): {ceiling:.0f} TFLOP/s\n")
    print(
        "| layer | rows | op | config | CUTLASS TFLOP/s | torch._grouped_mm TFLOP/s | "
        "vs torch | vs ceiling |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for layer, k, n in (("fc1", 2048, 1536), ("fc2", 768, 2048)):
        for rows in (8192, 32768, 65536):
            for line in _gpu_rows(cg, lib, layer, k, n, rows, ceiling, reps):
                print(line)


def _gpu_rows(cg, lib, layer: str, k: int, n: int, rows: int, ceiling: float, reps: int):
    groups = 128
    counts = skewed_counts(rows, groups, seed=rows)
    ends = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(groups, k, n, device="cuda") / k**0.5).to(torch.bfloat16)
    dy = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    wt = w.transpose(1, 2)
    ops = {
        "fwd": (lambda: cg.fwd(x, w, ends, lib=lib), lambda: torch._grouped_mm(x, w, offs=ends)),
        "dgrad": (lambda: cg.dgrad(dy, w, ends, lib=lib),
                  lambda: torch._grouped_mm(dy, wt, offs=ends)),
        "wgrad": (lambda: cg.wgrad(x, dy, ends, lib=lib),
                  lambda: torch._grouped_mm(x.t(), dy, offs=ends)),
    }  # fmt: skip
    config = cg.picked_config(rows, groups, k, n, lib=lib)
    flops = 2.0 * rows * k * n
    for op, (ours, theirs) in ops.items():
        t_ours, t_theirs = _gpu_time(ours, reps), _gpu_time(theirs, reps)
        ours_tf, theirs_tf = flops / t_ours / 1e12, flops / t_theirs / 1e12
        yield (
            f"| {layer} | {rows} | {op} | {config if op != 'wgrad' else 'coop'} | "
            f"{ours_tf:.0f} | {theirs_tf:.0f} | {t_theirs / t_ours:.2f}x | "
            f"{ours_tf / ceiling:.0%} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="time the CUTLASS kernels on sm_90")
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args()
    if args.gpu:
        run_gpu(args.reps or 20)
    else:
        run_cpu(args.reps or 5)


if __name__ == "__main__":
    main()
