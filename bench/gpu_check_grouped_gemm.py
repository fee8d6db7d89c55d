"""Timing stage of bench/gpu_check.sh for the CUTLASS grouped GEMM (one sm_90 GPU).

For 30B-A3B-class expert shapes (128 experts, fc1 2048 -> 1536, fc2 768 -> 2048, 65536 routed
rows), with uniform routing and with skewed (Zipf) routing that leaves at least 1 in 8 experts
empty, times forward, dgrad and wgrad of our kernels against `torch._grouped_mm` on the same
preallocated inputs (drawn on the GPU), and against the measured dense bf16 matmul ceiling.
One verdict per (op, routing), the worst of the two layers: PASS needs >= 1.10x
torch._grouped_mm AND >= 60% of the ceiling AND every group of our output within an
elementwise tolerance of an fp32 reference computed per group from the same bf16 inputs
(`check_groups`; a fast wrong kernel must not pass), and for wgrad the dW of every empty group
exactly zero. torch's output is held to the same reference and shown beside ours (if torch
fails it too, suspect the reference). Each row is written as soon as its check ends
(`run_check`): an exception in one op, ours or torch's, is that row's FAIL and the other rows
still run. The elapsed seconds of each part (inputs, first calls, reference, timing) are
printed so a slow part shows in the log.

    python bench/gpu_check_grouped_gemm.py --verdicts V.tsv --report R.md
    python bench/gpu_check_grouped_gemm.py --dry-run     # CPU: the same code on tiny shapes,
                                                         # torch on both sides, bf16
"""

from __future__ import annotations

import functools
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from gpu_check_common import (
    Memo,
    guarded,
    matmul_ceiling_flops,
    run_check,
    stage_parser,
    time_per_call,
)
from grouped_gemm import skewed_counts

SPEEDUP_TARGET = 1.10
CEILING_TARGET = 0.60
LAYERS = (("fc1", 2048, 1536), ("fc2", 768, 2048))
DRY_LAYERS = (("fc1", 64, 32), ("fc2", 32, 64))
OPS = ("fwd", "dgrad", "wgrad")
ROUTINGS = ("uniform", "skewed")
CHECKS = [f"grouped GEMM {op} ({routing})" for routing in ROUTINGS for op in OPS]

# Elementwise tolerance of an output element against the fp32 reference of its group:
#     |out - ref| <= BF16_RTOL * |ref| + ACC_SLACK * K * FP32_U * s,   s = sqrt(sum_l a_l^2 b_l^2)
# with K the reduction length of that group (k for fwd, n for dgrad, the group's rows for
# wgrad). Why this bound: the products of two bf16 values are exact in fp32, so a kernel that
# accumulates in fp32 and rounds once to bf16 differs from the exact sum by (1) the final
# rounding, at most half a bf16 ulp = 2^-8 |value| (we allow a whole ulp, 2^-7, for an
# epilogue that truncates), and (2) fp32 accumulation error: each of the K additions rounds the
# partial sum once (<= 2^-24 |partial|, twice that if the adder truncates); for these
# zero-mean random inputs the partial sums stay within a few s (a random walk whose end is the
# typical |ref|), so that error is at most ~4 K 2^-24 s; the fp32 reference (another order)
# has the same again, hence ACC_SLACK = 8 for both. Typical errors are far smaller (~sqrt(K)),
# so a correct kernel sits well inside, while a wrong row, tile or group is off by ~s: fwd
# (K = 2048) allows 7.8e-3 |ref| + 1e-3 s; the hot wgrad group (K ~ 19k rows) 7.8e-3 |ref| +
# 9e-3 s, where one dropped 128-row tile moves elements by ~0.08 s. (The old single global-norm
# check at 2e-2 could not see ~15 bad rows of 65536: their share of the norm is ~1.5e-2.)
BF16_RTOL = 2.0**-7
FP32_U = 2.0**-24
ACC_SLACK = 8.0


def _counts(routing: str, rows: int, groups: int) -> list[int]:
    if routing == "uniform":
        return [rows // groups] * groups
    counts = skewed_counts(rows, groups, seed=rows + groups)
    for small in sorted(range(groups), key=counts.__getitem__)[: max(1, groups // 8)]:
        counts[max(range(groups), key=counts.__getitem__)] += counts[small]
        counts[small] = 0  # at least 1 in 8 experts empty, whatever the draw
    return counts


def _target(op: str) -> str:
    target = (
        f">={SPEEDUP_TARGET:.2f}x torch._grouped_mm, >={CEILING_TARGET:.0%} of ceiling, "
        "every group within tol of fp32 ref"
    )
    return target + (", empty groups' dW == 0" if op == "wgrad" else "")


def _op_fns(op: str, x, w, dy, ends, lib, dry: bool):
    """(ours, torch's) callables of `op` over preallocated tensors."""
    theirs = {
        "fwd": lambda: torch._grouped_mm(x, w, offs=ends),
        "dgrad": lambda: torch._grouped_mm(dy, w.transpose(1, 2), offs=ends),
        "wgrad": lambda: torch._grouped_mm(x.t(), dy, offs=ends),
    }[op]
    if dry:  # no GPU: the harness is exercised with torch on both sides
        return theirs, theirs
    from art_megatron_ext.ops import cutlass_grouped_gemm as cg

    ours = {
        "fwd": lambda: cg.fwd(x, w, ends, lib=lib),
        "dgrad": lambda: cg.dgrad(dy, w, ends, lib=lib),
        "wgrad": lambda: cg.wgrad(x, dy, ends, lib=lib),
    }[op]
    return ours, theirs


class GroupErrors:
    """How one output compares with the per-group fp32 reference. (A plain class: the test of
    bench/gpu_check.sh loads this file without registering it in sys.modules, which
    `dataclass` needs for string annotations.)"""

    def __init__(self, empty_nonzero: tuple[int, int] | None = None):
        self.worst_ratio = 0.0
        """max over elements of |out - ref| / tol (inf for a non-finite element)."""
        self.worst_group = -1
        self.worst_err = 0.0
        """max |out - ref| inside the worst group."""
        self.groups_outside = 0
        self.empty_nonzero = empty_nonzero
        """(group, nonzero elements) of the first empty group whose dW is not exactly zero."""

    @property
    def ok(self) -> bool:
        return self.worst_ratio <= 1.0 and self.empty_nonzero is None


def _group_operands(op: str, x, w, dy, start: int, end: int, g: int):
    """(A, B) in fp32 with the group's output = A @ B."""
    if op == "fwd":
        return x[start:end].float(), w[g].float()
    if op == "dgrad":
        return dy[start:end].float(), w[g].float().t()
    return x[start:end].float().t(), dy[start:end].float()


def check_groups(op: str, outs: dict[str, torch.Tensor], x, w, dy, counts) -> dict:
    """{name: GroupErrors} of each output in `outs` against the fp32 reference, group by group
    (tolerance: see BF16_RTOL above); for wgrad the dW of an empty group must be exactly 0."""
    ratios = {name: [] for name in outs}
    errs = {name: [] for name in outs}
    empty = {name: None for name in outs}
    checked: list[int] = []
    start = 0
    for g, m in enumerate(counts):
        end = start + m
        if m == 0:
            if op == "wgrad":
                for name, out in outs.items():
                    nonzero = int(torch.count_nonzero(out[g]))  # NaN counts as nonzero
                    if nonzero and empty[name] is None:
                        empty[name] = (g, nonzero)
            continue  # fwd/dgrad: an empty group owns no output rows
        a, b = _group_operands(op, x, w, dy, start, end, g)
        ref = a @ b
        scale = ((a * a) @ (b * b)).sqrt_()
        tol = (ref.abs() * BF16_RTOL).add_(scale, alpha=ACC_SLACK * a.shape[1] * FP32_U)
        tol.clamp_min_(torch.finfo(torch.float32).tiny)
        for name, out in outs.items():
            got = out[g] if op == "wgrad" else out[start:end]
            err = (got.float() - ref).abs_()
            ratios[name].append(torch.nan_to_num(err / tol, nan=math.inf).amax())
            errs[name].append(torch.nan_to_num(err, nan=math.inf).amax())
        checked.append(g)
        start = end
    result = {}
    for name in outs:
        found = GroupErrors(empty_nonzero=empty[name])
        if checked:
            group_ratios = torch.stack(ratios[name]).tolist()
            group_errs = torch.stack(errs[name]).tolist()
            i = max(range(len(checked)), key=group_ratios.__getitem__)
            found.worst_ratio, found.worst_group = group_ratios[i], checked[i]
            found.worst_err = group_errs[i]
            found.groups_outside = sum(not r <= 1.0 for r in group_ratios)
        result[name] = found
    return result


def _wrong_text(layer: str, found: GroupErrors, groups: int) -> str:
    if math.isinf(found.worst_err):
        return (
            f"WRONG {layer} group {found.worst_group}: non-finite output "
            f"({found.groups_outside}/{groups} groups outside tol)"
        )
    if found.worst_ratio > 1.0:
        return (
            f"WRONG {layer} group {found.worst_group}: max err {found.worst_err:.1e} = "
            f"{found.worst_ratio:.1f}x tol ({found.groups_outside}/{groups} groups outside)"
        )
    g, nonzero = found.empty_nonzero
    return f"WRONG {layer} empty group {g}: dW has {nonzero} nonzero elements"


class _Stage:
    """The inputs, library and ceiling, each made once on first use (`Memo`: a failure is kept
    and re-raised, so every row it affects says why without paying for it again)."""

    def __init__(self, dry: bool, report: Path | None, iters: int):
        self.dry, self.report, self.iters = dry, report, iters
        self.device = "cpu" if dry else "cuda"
        self.rows, self.groups = (256, 4) if dry else (65536, 128)
        self.layers = DRY_LAYERS if dry else LAYERS
        self._memo = Memo(self.clock)
        if report is not None:
            report.write_text("")

    def emit(self, line: str) -> None:
        print(line, flush=True)
        if self.report is not None:
            with open(self.report, "a") as f:
                f.write(line + "\n")

    def clock(self) -> float:
        if not self.dry:
            torch.cuda.synchronize()
        return time.perf_counter()

    def ceiling(self) -> float:
        def measure() -> float:
            n = 256 if self.dry else 8192
            if self.dry:  # the CPU's own rate, so the dry run's percentages read sensibly
                a = torch.randn(n, n, dtype=torch.bfloat16)
                flops = 2 * n**3 / time_per_call(lambda: a @ a, self.iters, cuda=False)
            else:
                flops = matmul_ceiling_flops(n)
            self.emit(
                f"dense bf16 ceiling (torch.mm {n}^3, random data): {flops / 1e12:.3g} TFLOP/s"
            )
            return flops

        return self._memo.get("matmul ceiling", measure)

    def lib(self):
        if self.dry:
            return None
        from art_megatron_ext.ops import cutlass_grouped_gemm as cg

        return self._memo.get("load CUTLASS grouped GEMM library", cg.load_library)

    def inputs(self, routing: str):
        """(counts, ends, {layer: (x, w, dy)}) in bf16, drawn on the device."""

        def make():
            counts = _counts(routing, self.rows, self.groups)
            ends = torch.tensor(counts, device=self.device).cumsum(0).to(torch.int32)
            gen = torch.Generator(device=self.device).manual_seed(ROUTINGS.index(routing))
            bf16 = {"generator": gen, "device": self.device, "dtype": torch.bfloat16}
            tensors = {}
            for layer, k, n in self.layers:
                x = torch.randn(self.rows, k, **bf16)
                w = torch.randn(self.groups, k, n, **bf16).mul_(k**-0.5)
                dy = torch.randn(self.rows, n, **bf16)
                tensors[layer] = (x, w, dy)
            return counts, ends, tensors

        return self._memo.get(f"{routing} inputs ({self.device}, bf16)", make)

    def drop_inputs(self, routing: str) -> None:
        self._memo.drop(f"{routing} inputs ({self.device}, bf16)")

    def measure(self, op: str, routing: str) -> tuple[str, bool]:
        """(measured, ok) of one (op, routing) row: the worst of the two layers."""
        counts, ends, tensors = self.inputs(routing)
        ceiling, lib = self.ceiling(), self.lib()
        speedup = frac = math.inf
        wrong = None
        worst_ratio = 0.0
        for layer, k, n in self.layers:
            x, w, dy = tensors[layer]
            ours, theirs = _op_fns(op, x, w, dy, ends, lib, self.dry)
            t0 = self.clock()
            outs = {"ours": ours(), "torch": theirs()}
            if not self.dry:
                from art_megatron_ext.ops import cutlass_grouped_gemm as cg

                self.clock()
                cg.check_device_errors()
            t1 = self.clock()
            found = check_groups(op, outs, x, w, dy, counts)
            del outs
            t2 = self.clock()
            t_ours = time_per_call(ours, self.iters, cuda=not self.dry)
            t3 = self.clock()
            t_theirs = time_per_call(theirs, self.iters, cuda=not self.dry)
            t4 = self.clock()
            print(
                f"elapsed: {routing} {layer} {op}: first calls {t1 - t0:.2f} s, fp32 reference "
                f"{t2 - t1:.2f} s, timing ours {t3 - t2:.2f} s, timing torch {t4 - t3:.2f} s",
                flush=True,
            )
            flops = 2.0 * self.rows * k * n
            layer_speedup, layer_frac = t_theirs / t_ours, flops / t_ours / ceiling
            self.emit(
                f"| {layer} | {routing} | {op} | {flops / t_ours / 1e12:.1f} | "
                f"{flops / t_theirs / 1e12:.1f} | {layer_speedup:.2f}x | {layer_frac:.0%} | "
                f"{_err_cell(found['ours'])} | {_err_cell(found['torch'])} |"
            )
            speedup, frac = min(speedup, layer_speedup), min(frac, layer_frac)
            worst_ratio = max(worst_ratio, found["ours"].worst_ratio)
            if wrong is None and not found["ours"].ok:
                wrong = _wrong_text(layer, found["ours"], self.groups)
                if not found["torch"].ok:
                    wrong += " (torch's too: suspect the reference)"
        fast = speedup >= SPEEDUP_TARGET and frac >= CEILING_TARGET
        measured = f"{speedup:.2f}x torch, {frac:.0%} of ceiling, "
        measured += wrong or f"worst group at {worst_ratio:.2f} of tol"
        if op == "wgrad" and wrong is None and 0 in counts:
            measured += f", {counts.count(0)} empty groups' dW 0"
        if self.dry:  # torch on both sides: only the harness and the oracle are judged
            return measured + " (dry run: speed not judged)", wrong is None
        return measured, wrong is None and fast


def _err_cell(found: GroupErrors) -> str:
    text = f"{found.worst_ratio:.2f} (g{found.worst_group}, {found.worst_err:.1e})"
    if found.empty_nonzero is not None:
        text += f"; empty g{found.empty_nonzero[0]} dW != 0"
    return text


def run(dry: bool, verdicts: Path | None, report: Path | None, iters: int) -> int:
    """Run the six checks, each row written as it ends; returns the number not PASS."""
    t_start = time.perf_counter()
    # the reference must be real fp32: no TF32 (10-bit mantissa) in its matmuls
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    stage = _Stage(dry, report, iters)
    stage.emit(
        "| layer | routing | op | ours TFLOP/s | torch TFLOP/s | vs torch | vs ceiling | "
        "ours worst err/tol (group, max err) | torch's |"
    )
    stage.emit("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    failed = 0
    for routing in ROUTINGS:
        for op in OPS:
            check = f"grouped GEMM {op} ({routing})"
            measure = functools.partial(stage.measure, op, routing)
            failed += not run_check(verdicts, check, _target(op), measure, dry)
        stage.drop_inputs(routing)  # frees the routing's inputs before the next one's
    print(f"elapsed: grouped GEMM stage total {time.perf_counter() - t_start:.1f} s", flush=True)
    return failed


def main() -> int:
    args = stage_parser(__doc__, iters=20).parse_args()
    failed = guarded(
        lambda: run(args.dry_run, args.verdicts, args.report, args.iters), args, CHECKS
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
