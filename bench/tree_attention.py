"""Benchmark: tree attention on one packed row vs the dense-mask path, forward + backward.

Workload per row length S: single-turn groups shaped like bench/packing.py, scaled to S
(8 rollouts of S/32 .. S/8 tokens behind an S/32-token prompt), packed with seq_len S; the
first row is measured. q has 8 heads, k/v 2 (grouped-query), head dim 32, fp32.

Methods:
  tree:  `art_megatron_ext.packing.tree_attention` (blockwise, recompute backward).
  dense: `scaled_dot_product_attention` with the `[1, 1, S, S]` bool tree mask (the path a
         trainer takes with `tree_attention_mask`); the mask is built inside the measurement.
Each (S, method) runs in its own process with --threads torch threads (default 1: on the
shared, loaded 2-core host a second thread mostly waits for a core, which hurts the kernel's
many small ops far more than SDPA's few large ones): CPU time and wall time of fwd+bwd (best
of --repeats; compare CPU times on a loaded host) and peak RSS above the process's RSS before
the first call (`ru_maxrss`). Dense is skipped above
--dense-max (its mask alone is S*S bytes, and SDPA turns it into an S*S float bias).

Run: .venv-train/bin/python bench/tree_attention.py [--sizes 4096 16384 32768] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import numpy as np

HEADS, KV_HEADS, DIM, VOCAB = 8, 2, 32, 32_000


def _row(seq: int):
    from art_megatron_ext.packing import PackingConfig, Trajectory, TrajectoryGroup, pack_groups

    rng = np.random.default_rng(0)
    prompt_len = seq // 32
    groups = []
    for _ in range(6):
        prompt = rng.integers(0, VOCAB, prompt_len)
        members = []
        for _ in range(8):
            n = int(rng.integers(seq // 32, seq // 8))
            tokens = np.concatenate([prompt, rng.integers(0, VOCAB, n)])
            mask = np.arange(len(tokens)) >= prompt_len
            members.append(Trajectory(tokens, mask))
        groups.append(TrajectoryGroup(members))
    batch = pack_groups(groups, PackingConfig(seq_len=seq, vocab_size=VOCAB))
    return batch.subtree_end[:1]


def _child(seq: int, method: str, repeats: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from art_megatron_ext.packing import plan_tree_attention, tree_attention_mask
    from art_megatron_ext.packing.tree_attention import tree_attention

    torch.manual_seed(0)
    subtree_end = _row(seq)
    q = torch.randn(1, HEADS, seq, DIM, requires_grad=True)
    k = torch.randn(1, KV_HEADS, seq, DIM, requires_grad=True)
    v = torch.randn(1, KV_HEADS, seq, DIM, requires_grad=True)
    upstream = torch.randn(1, HEADS, seq, DIM)
    plan = plan_tree_attention(subtree_end)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def step():
        if method == "tree":
            out = tree_attention(q, k, v, subtree_end)
        else:
            mask = tree_attention_mask(subtree_end)[:, None]
            repeat = HEADS // KV_HEADS
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1), attn_mask=mask
            )
        out.backward(upstream)
        q.grad = k.grad = v.grad = None

    times, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "seq": seq,
        "method": method,
        "seconds": min(times),
        "cpu_seconds": min(cpu),
        "peak_mib": (peak - rss_before) / 2**20,
        "visible_fraction": plan.visible_tiles / plan.total_tiles,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dense-max", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", nargs=2, metavar=("SEQ", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        seq, method = int(args.child[0]), args.child[1]
        print(json.dumps(_child(seq, method, args.repeats, args.threads)))
        return
    print(
        f"heads {HEADS} (kv {KV_HEADS}), head dim {DIM}, fp32, one packed row, fwd+bwd, "
        f"{args.threads} thread(s)"
    )
    for seq in args.sizes:
        results = {}
        for method in ("tree", "dense"):
            if method == "dense" and seq > args.dense_max:
                continue
            run = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    str(seq),
                    method,
                    "--repeats",
                    str(args.repeats),
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            results[method] = json.loads(run.stdout.strip().splitlines()[-1])
        tree = results["tree"]
        line = (
            f"S={seq}: tree {tree['cpu_seconds']:.2f} s CPU ({tree['seconds']:.2f} s wall), "
            f"peak +{tree['peak_mib']:.0f} MiB "
            f"(tiles kept {tree['visible_fraction']:.1%} of causal)"
        )
        if "dense" in results:
            dense = results["dense"]
            line += (
                f"; dense {dense['cpu_seconds']:.2f} s CPU ({dense['seconds']:.2f} s wall), "
                f"peak +{dense['peak_mib']:.0f} MiB; "
                f"dense/tree CPU time {dense['cpu_seconds'] / tree['cpu_seconds']:.2f}x, "
                f"memory {dense['peak_mib'] / max(tree['peak_mib'], 1):.1f}x"
            )
        else:
            line += f"; dense skipped (mask alone {seq * seq / 2**30:.2f} GiB)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
