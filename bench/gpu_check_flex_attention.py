"""Timing stage of bench/gpu_check.sh for tree attention on FlexAttention (one CUDA GPU).

On packed rows shaped like GRPO batches (groups of 8 rollouts behind a shared prompt, packed
into 2 rows of 8192 tokens; 32 query heads, 8 kv heads, head dim 128, bf16), times forward +
backward of three paths on the same preallocated inputs:
  flex:  `flex_tree_attention` with the `BlockMask` of the `TreePlan` (compiled; the GPU path;
         full tiles skip the mask function; all rows in one call);
  dense: `scaled_dot_product_attention` with the boolean tree mask `[rows, 1, S, S]` from
         `tree_attention_mask` (k/v repeated to the query heads inside the call);
  tiled: the Python tile loop `tree_attention` (the CPU path and oracle), the same shape but
         fewer timed calls (it launches thousands of small kernels per call).
The plan, the block mask and the dense mask are built once, outside the clock (a trainer
builds them once per batch and reuses them in every layer). Outputs and q/k/v gradients of
each path are compared with the tiled kernel run in fp32 (relative error, Frobenius norm).
Verdicts: flex agrees with the fp32 reference within bf16 tolerance (no worse than twice dense
SDPA's bf16 error, and at most 2e-2); flex is at least SPEEDUP_VS_DENSE x dense SDPA and
SPEEDUP_VS_TILED x the tiled kernel (a fast wrong kernel does not pass). First bounds, set before
any GPU measurement; recorded numbers go to bench/RESULTS.md.

    python bench/gpu_check_flex_attention.py --verdicts V.tsv --report R.md
    python bench/gpu_check_flex_attention.py --dry-run   # CPU: the same code on a tiny shape,
                                                         # the tiled kernel standing in for flex
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch
import torch.nn.functional as F
from gpu_check_common import guarded, record_verdicts, stage_parser, time_per_call

SPEEDUP_VS_DENSE = 1.0
SPEEDUP_VS_TILED = 2.0
ERR_CAP = 2e-2
VOCAB = 32_000
CHECKS = [
    "FlexAttention tree fwd+bwd agrees with fp32 reference",
    "FlexAttention tree fwd+bwd vs dense SDPA (tree mask)",
    "FlexAttention tree fwd+bwd vs tiled kernel",
]
GPU_SHAPE = dict(rows=2, seq=8192, heads=32, kv_heads=8, dim=128, block=128, prompt=1024)
DRY_SHAPE = dict(rows=2, seq=256, heads=4, kv_heads=2, dim=16, block=16, prompt=32)


def packed_subtree_end(rows: int, seq: int, prompt: int) -> torch.Tensor:
    """`subtree_end` of the first `rows` rows of a packed batch: groups of 8 rollouts of
    prompt/4 .. prompt tokens behind a shared `prompt`-token prompt."""
    from art_megatron_ext.packing import PackingConfig, Trajectory, TrajectoryGroup, pack_groups

    rng = np.random.default_rng(0)
    groups = []
    for _ in range(4 * rows):
        shared = rng.integers(0, VOCAB, prompt)
        members = []
        for _ in range(8):
            tokens = np.concatenate(
                [shared, rng.integers(0, VOCAB, rng.integers(prompt // 4, prompt))]
            )
            members.append(Trajectory(tokens, np.arange(len(tokens)) >= prompt))
        groups.append(TrajectoryGroup(members))
    batch = pack_groups(groups, PackingConfig(seq_len=seq, vocab_size=VOCAB))
    if batch.subtree_end.shape[0] < rows:
        raise RuntimeError(f"packed {batch.subtree_end.shape[0]} rows, need {rows}")
    return batch.subtree_end[:rows]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _fwd_bwd(fn, q, k, v, upstream):
    """One forward + backward; returns (out, dq, dk, dv) and leaves no grads behind."""
    out = fn(q, k, v)
    out.backward(upstream)
    grads = (q.grad, k.grad, v.grad)
    q.grad = k.grad = v.grad = None
    return (out.detach(), *grads)


def run(dry: bool, verdicts: Path | None, report: Path | None, iters: int) -> int:
    from art_megatron_ext.packing import plan_tree_attention, tree_attention_mask
    from art_megatron_ext.packing.flex_tree_attention import flex_tree_attention, tree_block_mask
    from art_megatron_ext.packing.tree_attention import TreeAttentionConfig, tree_attention

    shape = DRY_SHAPE if dry else GPU_SHAPE
    device, dtype = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
    rows, seq, heads, kv_heads, dim = (
        shape[n] for n in ("rows", "seq", "heads", "kv_heads", "dim")
    )
    group, scale = heads // kv_heads, 1.0 / math.sqrt(dim)
    t0 = time.perf_counter()
    ends_cpu = packed_subtree_end(rows, seq, shape["prompt"])
    ends = ends_cpu.to(device)
    plan = plan_tree_attention(ends_cpu, shape["block"])
    config = TreeAttentionConfig(block=shape["block"], chunk_keys=max(2048, shape["block"]))
    block_mask = tree_block_mask(ends, plan, rows_per_call=rows)  # one call: no padding
    dense_mask = tree_attention_mask(ends)[:, None]  # [rows, 1, S, S] bool
    setup_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    make = lambda h: torch.randn(rows, h, seq, dim, generator=gen)  # noqa: E731
    q32, k32, v32, up32 = make(heads), make(kv_heads), make(kv_heads), make(heads)
    q, k, v = (x.to(device, dtype).requires_grad_() for x in (q32, k32, v32))
    upstream = up32.to(device, dtype)

    def tiled(q, k, v):
        return tree_attention(q, k, v, ends, scale=scale, plan=plan, config=config)

    def dense(q, k, v):
        kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return F.scaled_dot_product_attention(q, kr, vr, attn_mask=dense_mask, scale=scale)

    def flex(q, k, v):
        return flex_tree_attention(q, k, v, block_mask, scale=scale)

    paths = {"flex": tiled if dry else flex, "dense": dense, "tiled": tiled}
    # the fp32 reference: the tiled kernel on fp32 copies of the same inputs
    t0 = time.perf_counter()
    ref_in = [x.detach().to(device, torch.float32).requires_grad_() for x in (q, k, v)]
    ref = _fwd_bwd(tiled, *ref_in, upstream.float())
    ref_s = time.perf_counter() - t0
    if dry:  # FlexAttention's forward runs eagerly on CPU (no backward): check it, time nothing
        qd, kd, vd = (x.detach() for x in (q, k, v))
        flex_out = flex_tree_attention(qd, kd, vd, block_mask, scale=scale, compiled=False)
        err = _rel_err(flex_out, ref[0])
        print(f"dry run: eager FlexAttention forward vs the fp32 reference: rel err {err:.1e}")
        print("dry run: the tiled kernel stands in for flex below (no CPU backward)")
    errs, secs = {}, {}
    first_call_s = 0.0
    for name, fn in paths.items():
        t0 = time.perf_counter()
        got = _fwd_bwd(fn, q, k, v, upstream)  # also the warm-up (flex: the compile)
        if not dry:
            torch.cuda.synchronize()
        if name == "flex":
            first_call_s = time.perf_counter() - t0
        errs[name] = max(_rel_err(a, b) for a, b in zip(got, ref, strict=True))
        n, repeats = (iters, 3) if name != "tiled" else (1, 2 if ref_s < 5 else 1)
        secs[name] = time_per_call(
            lambda fn=fn: _fwd_bwd(fn, q, k, v, upstream), n, repeats, cuda=not dry
        )
    lines = [
        f"rows {rows} x {seq} tokens, heads {heads} (kv {kv_heads}), head dim {dim}, {dtype}, "
        f"block {plan.block}: {plan.visible_tiles / plan.total_tiles:.0%} of the causal tiles "
        f"visible; plan + masks {setup_s:.1f} s (host, once per batch); flex compile + first "
        f"call {first_call_s:.1f} s; fp32 reference {ref_s:.1f} s",
        "",
        "| path | fwd+bwd ms | flex speedup | max rel err vs fp32 (out, dq, dk, dv) |",
        "| --- | --- | --- | --- |",
    ]
    for name in paths:
        lines.append(
            f"| {name} | {secs[name] * 1e3:.2f} | {secs[name] / secs['flex']:.2f}x | "
            f"{errs[name]:.1e} |"
        )
    text = "\n".join(lines)
    print(text, flush=True)
    if report is not None:
        report.write_text(text + "\n")
    allowed = min(ERR_CAP, max(2 * errs["dense"], 1e-3))
    agrees = errs["flex"] <= allowed
    vs_dense, vs_tiled = secs["dense"] / secs["flex"], secs["tiled"] / secs["flex"]
    results = [
        (f"rel err {errs['flex']:.1e} (dense SDPA bf16 {errs['dense']:.1e})",
         f"<= {allowed:.1e} (2x dense SDPA's, at most {ERR_CAP:.0e})", agrees),
        (f"{vs_dense:.2f}x dense SDPA", f">={SPEEDUP_VS_DENSE:.2f}x and agrees",
         agrees and vs_dense >= SPEEDUP_VS_DENSE),
        (f"{vs_tiled:.2f}x tiled kernel", f">={SPEEDUP_VS_TILED:.2f}x and agrees",
         agrees and vs_tiled >= SPEEDUP_VS_TILED),
    ]  # fmt: skip
    rows = [(check, *result) for check, result in zip(CHECKS, results, strict=True)]
    return record_verdicts(verdicts, rows, dry)


def main() -> int:
    args = stage_parser(__doc__, iters=10).parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print(
            "gpu_check_flex_attention: no CUDA device is visible; this stage times FlexAttention "
            "on a GPU. Run with --dry-run to exercise the harness on CPU.",
            file=sys.stderr,
        )
        return 2
    failed = guarded(
        lambda: run(args.dry_run, args.verdicts, args.report, args.iters), args, CHECKS
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
