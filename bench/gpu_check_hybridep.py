"""HybridEP stages of bench/gpu_check.sh: W rank processes on the one GPU (gloo group, CUDA IPC).

`--timing`: for W = 2 and 4, each rank times its dispatch, its combine and dispatch+combine
(one CUDA event pair around many back-to-back collective calls, inputs preallocated), and the
torch reference backend (`all_to_all_single` over gloo, CPU tensors) on the same routing. The
aggregate bandwidth is the bytes every rank moved over the slowest rank's time, counted as the
copy ceiling is (bytes read + bytes written), against a device-to-device copy measured here.
Verdicts: dispatch and combine >= 70% of that ceiling; dispatch+combine faster than the torch
all-to-all reference (>= 1.0x).

`--sync-check`: W = 2, static-budget mode (`num_permuted_tokens` set): preprocess, dispatch,
permute, unpermute and combine under `torch.cuda.set_sync_debug_mode("error")`, so any
synchronizing torch call on that path raises; then the outputs are compared, bitwise, with the
torch backend's.

`--dry-run`: the same harness on CPU with the torch backend in both roles and tiny sizes; no
verdicts. Why W processes on ONE GPU: that is what the lent machine has. Kernels of different
processes time-slice on one GPU (no MPS), so these numbers are a floor for an NVLink node.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gpu_check_common import copy_ceiling_bytes_per_s, time_per_call, write_verdict

COPY_TARGET = 0.70
REF_TARGET = 1.0
WORLDS = (2, 4)
CHECKS = [
    *(f"HybridEP {op} W={w} vs copy ceiling" for w in WORLDS for op in ("dispatch", "combine")),
    *(f"HybridEP dispatch+combine W={w} vs torch all-to-all" for w in WORLDS),
    "HybridEP static-budget path: no host sync",
]


def _routing(rank: int, tokens: int, experts: int, topk: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234 + rank)
    scores = torch.rand(tokens, experts, generator=gen)
    return torch.zeros(tokens, experts, dtype=torch.bool).scatter_(
        1, scores.topk(topk, dim=1).indices, True
    )


def _spec(hidden: int, tokens: int, local: int, sms: int):
    from hybridep.backends import BufferSpec
    from hybridep.config import HybridEPConfig

    config = HybridEPConfig(num_sms_dispatch=sms, num_sms_combine=sms) if sms else None
    kwargs = {"config": config} if config is not None else {}
    return BufferSpec(
        hidden_dim=hidden, max_num_of_tokens_per_rank=tokens, num_local_experts=local, **kwargs
    )


def _timing_rank(rank: int, world: int, cfg: dict) -> dict:
    from hybridep.backends.torch_ref import TorchBackend

    dry = cfg["dry"]
    device = "cpu" if dry else "cuda"
    T, H, L = cfg["tokens"], cfg["hidden"], cfg["local"]
    spec = _spec(H, T, L, cfg["sms"])
    if dry:
        ours = TorchBackend(dist.group.WORLD, spec)
    else:
        from hybridep.backends.cuda import CudaBackend

        ours = CudaBackend(dist.group.WORLD, spec)
    routing = _routing(rank, T, world * L, cfg["topk"])
    gen = torch.Generator().manual_seed(rank)
    hidden_cpu = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    probs_cpu = torch.rand(T, world * L, generator=gen) * routing
    hidden, probs = hidden_cpu.to(device), probs_cpu.to(device)
    handle = ours.preprocess(routing.to(device), pad_multiple=1, num_permuted_tokens=None)
    recv, recv_probs = ours.dispatch(hidden, probs, handle)
    cuda, iters = not dry, cfg["iters"]
    dist.barrier()
    t_dispatch = time_per_call(lambda: ours.dispatch(hidden, probs, handle), iters, cuda=cuda)
    dist.barrier()
    t_combine = time_per_call(lambda: ours.combine(recv, recv_probs, handle), iters, cuda=cuda)
    dist.barrier()
    t_both = time_per_call(
        lambda: ours.combine(*ours.dispatch(hidden, probs, handle), handle), iters, cuda=cuda
    )
    ref = TorchBackend(dist.group.WORLD, spec)
    ref_handle = ref.preprocess(routing, pad_multiple=1, num_permuted_tokens=None)
    dist.barrier()
    t_ref = time_per_call(
        lambda: ref.combine(*ref.dispatch(hidden_cpu, probs_cpu, ref_handle), ref_handle),
        cfg["ref_iters"],
        repeats=1,
        cuda=False,
    )
    if hasattr(ours, "close"):
        ours.close()
    return {
        "recv_rows": handle.num_recv_rows,
        "tokens": T,
        "t_dispatch": t_dispatch,
        "t_combine": t_combine,
        "t_both": t_both,
        "t_ref": t_ref,
    }


def _sync_rank(rank: int, world: int, cfg: dict) -> dict:
    from hybridep.backends.cuda import CudaBackend
    from hybridep.backends.torch_ref import TorchBackend

    T, H, L = cfg["tokens"], cfg["hidden"], cfg["local"]
    spec = _spec(H, T, L, 0)
    ours, ref = CudaBackend(dist.group.WORLD, spec), TorchBackend(dist.group.WORLD, spec)
    routing = _routing(rank, T, world * L, cfg["topk"])
    gen = torch.Generator().manual_seed(rank)
    hidden = torch.randint(-8, 9, (T, H), generator=gen).to(torch.bfloat16)
    probs = torch.rand(T, world * L, generator=gen) * routing
    budget, pad = cfg["budget"], 16
    g_routing, g_hidden, g_probs = routing.cuda(), hidden.cuda(), probs.cuda()
    torch.cuda.synchronize()
    error = ""
    torch.cuda.set_sync_debug_mode("error")
    try:
        h = ours.preprocess(g_routing, pad_multiple=pad, num_permuted_tokens=budget)
        recv = ours.dispatch(g_hidden, g_probs, h)
        perm = ours.permute(*recv, h)
        back = ours.unpermute(perm[0] * 3, perm[1], h)
        out = ours.combine(*back, h)
    except RuntimeError as exc:
        error = str(exc).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    same = False
    if not error:
        hr = ref.preprocess(routing, pad_multiple=pad, num_permuted_tokens=budget)
        r_recv = ref.dispatch(hidden, probs, hr)
        r_perm = ref.permute(*r_recv, hr)
        r_out = ref.combine(*ref.unpermute(r_perm[0] * 3, r_perm[1], hr), hr)
        same = torch.equal(out[0].cpu(), r_out[0]) and torch.equal(out[1].cpu(), r_out[1])
    ours.close()
    return {"error": error, "same_as_torch": same}


def _child(rank, world, init_file, fn, cfg, queue) -> None:
    import traceback

    try:
        if not cfg["dry"]:
            torch.cuda.set_device(0)  # every rank on the one GPU
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
        )
        try:
            queue.put((rank, True, fn(rank, world, cfg)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(fn, world: int, cfg: dict) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            ctx.Process(target=_child, args=(r, world, init_file, fn, cfg, queue))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        results = [queue.get() for _ in procs]
        for p in procs:
            p.join()
    failed = [msg for _, ok, msg in results if not ok]
    if failed:
        raise RuntimeError(f"a rank failed:\n{failed[0]}")
    return [value for _, _, value in sorted(results, key=lambda r: r[0])]


def timing(dry: bool, verdicts: Path | None, report: Path | None, iters: int) -> int:
    if dry:
        cfg = dict(dry=True, tokens=64, hidden=32, local=2, topk=2, sms=0, iters=2, ref_iters=1)
        ceiling = 1.0
    else:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        cfg = dict(dry=False, tokens=4096, hidden=7168, local=8, topk=8, sms=sms, iters=iters,
                   ref_iters=2)  # fmt: skip
        from hybridep import build_hybridep_abi as abi

        abi.load_library()  # built once here; the ranks load the cached library
        ceiling = copy_ceiling_bytes_per_s()
    lines = [
        f"device-to-device copy ceiling (read + write): {ceiling / 1e9:.0f} GB/s; "
        f"T={cfg['tokens']} H={cfg['hidden']} L={cfg['local']} top-{cfg['topk']} bf16, "
        f"dispatch/combine grids {cfg['sms']} SMs",
        "",
        "| W | op | GB moved (all ranks) | slowest rank ms | GB/s | vs copy ceiling |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    rows: list[tuple[str, str, str, bool]] = []
    for world in (2,) if dry else WORLDS:  # a dry run checks the harness, W=2 is enough
        res = run_ranks(_timing_rank, world, cfg)
        row_bytes = cfg["hidden"] * 2
        recv_rows = sum(r["recv_rows"] for r in res)
        moved = {
            "dispatch": 2 * recv_rows * row_bytes,
            "combine": (recv_rows + world * cfg["tokens"]) * row_bytes,
        }
        for op in ("dispatch", "combine"):
            secs = max(r[f"t_{op}"] for r in res)
            frac = moved[op] / secs / ceiling
            lines.append(
                f"| {world} | {op} | {moved[op] / 1e9:.3f} | {secs * 1e3:.3f} | "
                f"{moved[op] / secs / 1e9:.0f} | {frac:.0%} |"
            )
            rows.append((f"HybridEP {op} W={world} vs copy ceiling", f"{frac:.0%} of ceiling",
                         f">={COPY_TARGET:.0%} of d2d copy", frac >= COPY_TARGET))  # fmt: skip
        t_both, t_ref = max(r["t_both"] for r in res), max(r["t_ref"] for r in res)
        lines.append(
            f"| {world} | dispatch+combine | - | {t_both * 1e3:.3f} | torch all-to-all "
            f"{t_ref * 1e3:.3f} ms | {t_ref / t_both:.2f}x faster |"
        )
        speedup = t_ref / t_both
        rows.append((f"HybridEP dispatch+combine W={world} vs torch all-to-all",
                     f"{speedup:.2f}x", f">={REF_TARGET:.1f}x", speedup >= REF_TARGET))  # fmt: skip
    text = "\n".join(lines)
    print(text, flush=True)
    if report is not None:
        report.write_text(text + "\n")
    if dry:
        for check, *_ in rows:
            print(f"dry run: would record {check!r}", flush=True)
        return 0
    for row in rows:
        write_verdict(verdicts, *row)
    return sum(not ok for *_, ok in rows)


def sync_check(verdicts: Path | None) -> int:
    check = "HybridEP static-budget path: no host sync"
    cfg = dict(dry=False, tokens=512, hidden=1024, local=4, topk=4, budget=512 * 4)
    try:
        res = run_ranks(_sync_rank, 2, cfg)
    except RuntimeError as exc:
        write_verdict(verdicts, check, f"ranks failed: {str(exc).splitlines()[-1]}", "", False)
        return 1
    errors = [r["error"] for r in res if r["error"]]
    same = all(r["same_as_torch"] for r in res)
    measured = errors[0] if errors else f"no sync; outputs equal torch backend: {same}"
    ok = not errors and same
    write_verdict(verdicts, check, measured, 'set_sync_debug_mode("error"), bitwise', ok)
    return int(not ok)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timing", action="store_true")
    parser.add_argument("--sync-check", action="store_true")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--verdicts", type=Path)
    parser.add_argument("--report", type=Path)
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    failed = 0
    if args.sync_check and not args.dry_run:
        failed += sync_check(args.verdicts)
    if args.timing or args.dry_run:
        failed += timing(args.dry_run, args.verdicts, args.report, args.iters)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
