"""Benchmark: HybridEP's torch backend against Megatron's own alltoall dispatcher (gloo, CPU).

Both sides run Megatron-core's dispatcher API for one dispatch + combine round trip with
identity experts (`dispatch_preprocess -> token_dispatch -> dispatch_postprocess ->
combine_preprocess -> token_combine -> combine_postprocess`), on the same routing, under the
test CPU shim, on spawned gloo ranks:

  alltoall      Megatron's MoEAlltoAllTokenDispatcher (the baseline)
  flex+hybridep MoEFlexTokenDispatcher with moe_flex_dispatcher_backend="hybridep", i.e.
                Megatron's autograd Functions over our hybridep.Buffer (torch backend)
  buffer        hybridep.Buffer alone (dispatch_with_permute + combine_with_unpermute)
  buffer static the same with a static budget (num_permuted_tokens; no host reads, equal
                splits of W*T rows, so more bytes move)

Reported: median wall time per round trip on rank 0 and its ratio to alltoall measured in the
same run (ratio < 1 is faster). The torch backend is the semantic reference, not the fast
path; this shows what it costs relative to Megatron's path on CPU.

Run: .venv-train/bin/python bench/hybridep_cpu.py [--ranks 2] [--tokens 2048] [--hidden 512]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

# tests/ holds the CPU shim and the rank spawner; the repo root goes first so that the
# test folders mirroring package names (tests/art_megatron_ext/...) never shadow the packages.
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_ROOT), str(_ROOT / "tests")]
from support.dist import run_ranks  # noqa: E402


def _time(fn, repeats: int) -> float:
    import torch.distributed as dist

    fn()  # warm-up (buffer creation, first-call allocations)
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _worker(rank: int, world: int, tokens: int, hidden: int, experts: int, topk: int, reps: int):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import (
        MoEAlltoAllTokenDispatcher,
        MoEFlexTokenDispatcher,
    )
    from support.megatron_cpu import cpu_shim, megatron_parallel, moe_test_config

    import hybridep
    from art_megatron_ext.moe import HybridEPOptions, enable_hybridep

    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=gen)
    scores = torch.rand(tokens, experts, generator=gen)
    top = scores.topk(topk, dim=1).indices
    routing = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, top, True)
    probs = scores * routing
    local = experts // world
    times = {}
    with cpu_shim(), megatron_parallel(ep=world), enable_hybridep(HybridEPOptions("torch")):
        common = dict(
            expert_model_parallel_size=world,
            num_moe_experts=experts,
            moe_router_topk=topk,
            hidden_size=hidden,
        )
        indices = list(range(rank * local, (rank + 1) * local))
        groups = get_default_pg_collection()
        for name, kind in (("alltoall", MoEAlltoAllTokenDispatcher), ("flex+hybridep", None)):
            if kind is None:
                config = moe_test_config(
                    moe_token_dispatcher_type="flex",
                    moe_flex_dispatcher_backend="hybridep",
                    **common,
                )
                dispatcher = MoEFlexTokenDispatcher(local, indices, config, groups)
            else:
                dispatcher = kind(local, indices, moe_test_config(**common), groups)

            def round_trip(d=dispatcher):
                h, p = d.dispatch_preprocess(x, routing, probs)
                h, p = d.token_dispatch(h, p)
                h, _, p = d.dispatch_postprocess(h, p)
                h = d.combine_preprocess(h)
                h = d.token_combine(h)
                return d.combine_postprocess(h)

            times[name] = _time(round_trip, reps)
        buf = hybridep.Buffer(torch.distributed.group.WORLD, hidden, tokens, local, backend="torch")

        def buffer_round_trip(budget=None):
            out, _, _, _, handle = buf.dispatch_with_permute(
                hidden=x, routing_map=routing, probs=probs, num_permuted_tokens=budget
            )
            return buf.combine_with_unpermute(hidden=out, handle=handle)

        times["buffer"] = _time(buffer_round_trip, reps)
        budget = tokens * topk * 2
        times["buffer static"] = _time(lambda: buffer_round_trip(budget), reps)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    results = run_ranks(
        _worker,
        args.ranks,
        args=(args.tokens, args.hidden, args.experts, args.topk, args.repeats),
        timeout_s=900,
    )
    times = results[0]
    base = times["alltoall"]
    print(
        f"HybridEP torch backend vs Megatron alltoall: {args.ranks} gloo ranks, "
        f"T={args.tokens}/rank, H={args.hidden}, E={args.experts}, top-{args.topk}, fp32, "
        f"median of {args.repeats}"
    )
    print(f"{'path':<16}{'ms / round trip':>18}{'ratio vs alltoall':>20}")
    for name, seconds in times.items():
        print(f"{name:<16}{seconds * 1e3:>18.2f}{seconds / base:>20.2f}")


if __name__ == "__main__":
    main()
