"""HybridEP stages of bench/gpu_check.sh: the kernels timed alone, then the ranks for real.

`--timing` (one process, bench/hybridep_local_world.py): for W = 2, 4 and 8 simulated ranks
(T=4096, H=7168, 8 local experts, top-8, bf16) the dispatch and the combine kernels of every
rank run back to back with nothing else in the timed region; their output is compared bit for
bit with the reference semantics before timing, and the bytes all ranks move over that time
are held against a device-to-device copy measured here (target >= 70%). Dispatch+combine is
also timed against the torch path on the same routing (gather + one all-to-all-sized copy
each way + fp32 index-add; target >= 1.0x). Two more cases check the bits only: H=12 (rows
not 16-byte aligned: the one-element path) and T=16384 at H=7168.

`--ranks` (W rank processes on the one GPU, CUDA IPC and device barriers, gloo group,
barrier_timeout_s=10): the fused paths Buffer takes (dispatch+permute from the registered
area, unpermute into it + combine) equal the torch backend bit for bit at W = 2 and 4, with
their time per round trip reported as what it is (processes time-slicing one GPU, barriers
included: a floor for an NVLink node, not a kernel figure); and the static-budget path runs
under `torch.cuda.set_sync_debug_mode("error")`.

Every check writes its row as it ends (gpu_check_common.run_check): an exception is that
row's FAIL, a dead or stuck rank is named by run_ranks (tests/support/dist.py) within its deadline,
and the rows after it still run. `--dry-run` runs the same harness on CPU (the reference in
the kernels' place, the torch backend in every rank) and writes no row.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from gpu_check_common import (
    Memo,
    copy_ceiling_bytes_per_s,
    guarded,
    run_check,
    stage_parser,
    time_per_call,
)
from hybridep_local_world import Case, LocalWorld, TorchPath

COPY_TARGET = 0.70
TORCH_TARGET = 1.0
WORLDS = (2, 4, 8)
RANK_WORLDS = (2, 4)
UNALIGNED = Case(world=4, tokens=512, hidden=12, local=4, topk=4, seed=3)
LARGE_T = Case(world=4, tokens=16384, hidden=7168, local=8, topk=8, seed=4)
TIMING_CHECKS = [
    *(
        f"HybridEP {op} W={w} kernels alone vs copy ceiling"
        for w in WORLDS
        for op in ("dispatch", "combine")
    ),
    *(f"HybridEP dispatch+combine W={w} vs torch path" for w in WORLDS),
    UNALIGNED_CHECK := "HybridEP H=12 (unaligned rows): dispatch+combine bitwise",
    LARGE_T_CHECK := "HybridEP T=16384 H=7168 W=4: dispatch+combine bitwise",
]
RANK_CHECKS = [
    *(f"HybridEP W={w} processes: fused paths bitwise = torch backend" for w in RANK_WORLDS),
    SYNC_CHECK := "HybridEP static-budget path: no host sync",
]
CHECKS = TIMING_CHECKS + RANK_CHECKS
RANKS_TIMEOUT_S = 90  # spawn + CUDA init of 4 processes is ~20 s; a stuck one is named after
RANK_THREADS = 4  # the torch reference runs on the CPU of the 16-core device host


def _elapsed(what: str, t0: float) -> None:
    print(f"elapsed: {what}: {time.monotonic() - t0:.1f} s", flush=True)


# -- one process: the kernels alone ------------------------------------------------------
def _timed_rows(case: Case, ceiling: float, iters: int, dry: bool, verdicts, lines) -> int:
    device = "cpu" if dry else "cuda"
    t0 = time.monotonic()
    memo = Memo()

    def world() -> LocalWorld:
        return memo.get(str(case), lambda: LocalWorld(case, device, kernels=not dry))

    failed = 0

    def ours(op: str):
        def measure():
            w = world()
            if not w.layouts_agree():
                return "the kernels' layout differs from the reference", False
            if op == "combine":
                w.fill_areas_for_combine()
            getattr(w, op)()
            bitwise = getattr(w, f"{op}_matches")()
            secs = time_per_call(getattr(w, op), iters, cuda=not dry)
            frac = w.moved_bytes(op) / secs / ceiling
            rate = w.moved_bytes(op) / secs / 1e9
            lines.append(f"| {case.world} | {op} | {w.moved_bytes(op) / 1e9:.3f} | "
                         f"{secs * 1e3:.3f} | {rate:.0f} | {frac:.0%} | {bitwise} |")  # fmt: skip
            text = f"{frac:.0%} of ceiling ({rate:.0f} GB/s), bitwise={bitwise}"
            return text, bitwise and (dry or frac >= COPY_TARGET)  # a dry run judges bits only

        return measure

    for op in ("dispatch", "combine"):
        check = f"HybridEP {op} W={case.world} kernels alone vs copy ceiling"
        target = f">={COPY_TARGET:.0%} of d2d copy, bitwise = reference"
        ok = run_check(verdicts, check, target, ours(op), dry)
        failed += not ok

    def versus_torch():
        w = world()
        path = TorchPath(w)
        t_ours = time_per_call(lambda: (w.dispatch(), w.combine()), iters, cuda=not dry)
        t_torch = time_per_call(lambda: (path.dispatch(), path.combine()), iters, cuda=not dry)
        lines.append(f"| {case.world} | dispatch+combine | - | {t_ours * 1e3:.3f} | torch path "
                     f"{t_torch * 1e3:.3f} ms | {t_torch / t_ours:.2f}x | - |")  # fmt: skip
        return f"{t_torch / t_ours:.2f}x", dry or t_torch / t_ours >= TORCH_TARGET

    check = f"HybridEP dispatch+combine W={case.world} vs torch path"
    failed += not run_check(verdicts, check, f">={TORCH_TARGET:.1f}x (gather + a2a copy + "
                            "index_add, one process)", versus_torch, dry)  # fmt: skip
    memo.drop(str(case))  # free this case's buffers before the next one
    if not dry:
        torch.cuda.empty_cache()
    _elapsed(f"timing {case}", t0)
    return failed


def _bitwise_row(name: str, case: Case, dry: bool, verdicts, iters: int) -> int:
    t0 = time.monotonic()

    def measure():
        w = LocalWorld(case, "cpu" if dry else "cuda", kernels=not dry)
        layout_ok = w.layouts_agree()
        w.dispatch()
        d_ok = w.dispatch_matches()
        w.fill_areas_for_combine()
        w.combine()
        c_ok = w.combine_matches()
        secs = time_per_call(lambda: (w.dispatch(), w.combine()), iters, cuda=not dry)
        text = (f"layout {layout_ok}, dispatch {d_ok}, combine {c_ok}; "
                f"{secs * 1e3:.2f} ms per dispatch+combine of all ranks")  # fmt: skip
        return text, layout_ok and d_ok and c_ok

    ok = run_check(verdicts, name, "bitwise = reference", measure, dry)
    if not dry:
        torch.cuda.empty_cache()
    _elapsed(f"bitwise {case}", t0)
    return int(not ok)


def timing(dry: bool, verdicts: Path | None, report: Path | None, iters: int) -> int:
    t0 = time.monotonic()
    if dry:
        worlds = [Case(world=w, tokens=64, hidden=32, local=2, topk=2, seed=w) for w in (2, 4)]
        unaligned = Case(world=2, tokens=16, hidden=12, local=2, topk=2, seed=3)
        large = Case(world=2, tokens=128, hidden=32, local=2, topk=2, seed=4)
        ceiling = 2 * (1 << 22) / time_per_call(
            functools.partial(torch.empty(1 << 22, dtype=torch.uint8).copy_,
                              torch.ones(1 << 22, dtype=torch.uint8)), 3, cuda=False)  # fmt: skip
        iters = 1
    else:
        worlds = [Case(world=w, tokens=4096, hidden=7168, local=8, topk=8, seed=w) for w in WORLDS]
        unaligned, large = UNALIGNED, LARGE_T
        ceiling = copy_ceiling_bytes_per_s()
    _elapsed("copy ceiling", t0)
    lines = [
        f"device-to-device copy ceiling (read + write): {ceiling / 1e9:.0f} GB/s; kernels of "
        "all W simulated ranks back to back in one process (no barrier, clone or staging in "
        "the timed region), every SM",
        "",
        "| W | op | GB moved (all ranks) | ms (all ranks) | GB/s | vs copy ceiling | bitwise |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    failed = 0
    for case in worlds:
        failed += _timed_rows(case, ceiling, iters, dry, verdicts, lines)
        if report is not None:  # the table so far survives a later stage's timeout
            report.write_text("\n".join(lines) + "\n")
    failed += _bitwise_row(UNALIGNED_CHECK, unaligned, dry, verdicts, iters)
    failed += _bitwise_row(LARGE_T_CHECK, large, dry, verdicts, iters)
    print("\n".join(lines), flush=True)
    if report is not None:
        report.write_text("\n".join(lines) + "\n")
    _elapsed("time-hybridep total", t0)
    return failed


# -- W processes: IPC, barriers, the fused paths -------------------------------------------
def _routing(rank: int, tokens: int, experts: int, topk: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234 + rank)
    scores = torch.rand(tokens, experts, generator=gen)
    return torch.zeros(tokens, experts, dtype=torch.bool).scatter_(
        1, scores.topk(topk, dim=1).indices, True
    )


def _spec(hidden: int, tokens: int, local: int):
    from hybridep.backends import BufferSpec
    from hybridep.config import HybridEPConfig

    config = HybridEPConfig(barrier_timeout_s=10.0)  # shorter than the stage's deadline
    return BufferSpec(
        hidden_dim=hidden, max_num_of_tokens_per_rank=tokens, num_local_experts=local,
        config=config,
    )  # fmt: skip


def _run_ranks(fn, world: int, cfg: dict) -> list:
    """`fn(rank, world, cfg)` on `world` gloo ranks (tests/support/dist.py: a rank that dies,
    raises or outlives the deadline is named, and no process outlives the call)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from support.dist import run_ranks

    return run_ranks(fn, world, (cfg,), timeout_s=RANKS_TIMEOUT_S, num_threads=RANK_THREADS)


def _on_the_gpu() -> None:
    torch.cuda.set_device(0)  # every rank on the one GPU


def _fused_rank(rank: int, world: int, cfg: dict) -> dict:
    """Fused dispatch+permute and unpermute+combine vs the torch backend, bitwise; then the
    fused round trip timed (time-slicing processes, barriers included)."""
    import torch.distributed as dist

    from hybridep.backends.torch_ref import TorchBackend

    dry, T, H, L = cfg["dry"], cfg["tokens"], cfg["hidden"], cfg["local"]
    if not dry:
        _on_the_gpu()
    spec = _spec(H, T, L)
    ref = TorchBackend(dist.group.WORLD, spec)
    if dry:
        ours, dev = TorchBackend(dist.group.WORLD, spec), (lambda t: t)
    else:
        from hybridep.backends.cuda import CudaBackend

        ours, dev = CudaBackend(dist.group.WORLD, spec), (lambda t: t.cuda())
    routing = _routing(rank, T, world * L, cfg["topk"])
    gen = torch.Generator().manual_seed(rank)
    hidden = torch.randint(-8, 9, (T, H), generator=gen).to(torch.bfloat16)
    probs = torch.rand(T, world * L, generator=gen) * routing
    fused_in = getattr(ours, "dispatch_permute", None)
    fused_out = getattr(ours, "unpermute_combine", None)
    if fused_in is None:  # the torch backend (dry run): its composition stands in
        fused_in = lambda h, p, hd: ours.permute(*ours.dispatch(h, p, hd), hd)  # noqa: E731
        fused_out = lambda t, p, hd: ours.combine(*ours.unpermute(t, p, hd), hd)  # noqa: E731
    h = ours.preprocess(dev(routing), pad_multiple=16, num_permuted_tokens=None)
    hr = ref.preprocess(routing, pad_multiple=16, num_permuted_tokens=None)
    tokens, tprobs = fused_in(dev(hidden), dev(probs), h)
    back = fused_out(tokens * 3, tprobs, h)
    r_tokens, r_probs = ref.permute(*ref.dispatch(hidden, probs, hr), hr)
    r_back = ref.combine(*ref.unpermute(r_tokens * 3, r_probs, hr), hr)
    pairs = ((tokens, r_tokens), (tprobs, r_probs), (back[0], r_back[0]), (back[1], r_back[1]))
    same = all(torch.equal(a.cpu(), b) for a, b in pairs)
    g_hidden, g_probs = dev(hidden), dev(probs)
    dist.barrier()
    secs = time_per_call(lambda: fused_out(*fused_in(g_hidden, g_probs, h), h), cfg["iters"],
                         cuda=not dry)  # fmt: skip
    if hasattr(ours, "close"):
        ours.close()
    return {"same": same, "secs": secs}


def _sync_rank(rank: int, world: int, cfg: dict) -> dict:
    """The static-budget path through the fused calls under sync debug mode "error"."""
    import torch.distributed as dist

    from hybridep.backends.cuda import CudaBackend
    from hybridep.backends.torch_ref import TorchBackend

    _on_the_gpu()
    T, H, L = cfg["tokens"], cfg["hidden"], cfg["local"]
    spec = _spec(H, T, L)
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
        perm = ours.dispatch_permute(g_hidden, g_probs, h)
        out = ours.unpermute_combine(perm[0] * 3, perm[1], h)
    except RuntimeError as exc:
        error = str(exc).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    same = False
    if not error:
        hr = ref.preprocess(routing, pad_multiple=pad, num_permuted_tokens=budget)
        r_perm = ref.permute(*ref.dispatch(hidden, probs, hr), hr)
        r_out = ref.combine(*ref.unpermute(r_perm[0] * 3, r_perm[1], hr), hr)
        same = torch.equal(out[0].cpu(), r_out[0]) and torch.equal(out[1].cpu(), r_out[1])
    ours.close()
    return {"error": error, "same_as_torch": same}


def ranks(dry: bool, verdicts: Path | None) -> int:
    t0 = time.monotonic()
    failed = 0
    cfg = dict(dry=dry, tokens=2048, hidden=7168, local=8, topk=8, iters=10)
    if dry:
        cfg.update(tokens=32, hidden=16, local=2, topk=2, iters=1)
    else:
        from hybridep import build_hybridep_abi as abi

        abi.load_library()  # built or found once here; the ranks load the cached library
    for w in RANK_WORLDS[:1] if dry else RANK_WORLDS:

        def fused(w=w):
            res = _run_ranks(_fused_rank, w, cfg)
            same = all(r["same"] for r in res)
            ms = max(r["secs"] for r in res) * 1e3
            text = (
                f"bitwise {same}; {ms:.2f} ms per fused round trip at T={cfg['tokens']} "
                f"H={cfg['hidden']} (processes time-slicing one GPU, barriers included)"
            )
            return text, same

        failed += not run_check(verdicts, f"HybridEP W={w} processes: fused paths bitwise = "
                                "torch backend", "bitwise = torch backend", fused, dry)  # fmt: skip
        _elapsed(f"ranks W={w}", t0)
    if dry:
        print("dry run: the static-budget sync check needs CUDA (not run)", flush=True)
        return 0

    def sync():
        sync_cfg = dict(dry=False, tokens=512, hidden=1024, local=4, topk=4, budget=512 * 4)
        res = _run_ranks(_sync_rank, 2, sync_cfg)
        errors = [r["error"] for r in res if r["error"]]
        same = all(r["same_as_torch"] for r in res)
        return (errors[0] if errors else f"no sync; outputs equal torch backend: {same}",
                not errors and same)  # fmt: skip

    failed += not run_check(verdicts, SYNC_CHECK, 'set_sync_debug_mode("error"), bitwise', sync)
    _elapsed("hybridep-ranks total", t0)
    return failed


def main() -> int:
    parser = stage_parser(__doc__, iters=20)
    parser.add_argument("--timing", action="store_true", help="one process, kernels alone")
    parser.add_argument("--ranks", action="store_true", help="W processes, IPC, fused paths")
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print(
            "gpu_check_hybridep: no CUDA device is visible; use --dry-run on CPU", file=sys.stderr
        )
        return 2
    failed = 0
    if args.ranks or args.dry_run:
        failed += guarded(lambda: ranks(args.dry_run, args.verdicts), args, RANK_CHECKS)
    if args.timing or args.dry_run:
        run_timing = lambda: timing(args.dry_run, args.verdicts, args.report, args.iters)  # noqa: E731
        failed += guarded(run_timing, args, TIMING_CHECKS)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
