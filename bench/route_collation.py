"""Benchmark: route collation into the [batch, seq, layers, topk] tensor, one write per byte.

Batch: rows of seq_len 8192 tokens x 48 layers x top-8 uint8 (3 MiB a row), trajectory lengths
uniform in [seq_len/2, seq_len] (about 25% padding, right-padded); the routes are views into
one received buffer, as a decoded route bundle gives them. Output sizes 0.4, 1.6 and 4 GB.

Compared, all in the same run, each including its `torch.empty` (page faults included):
  floor     one torch.empty of the output size + one copy of the same number of bytes from a
            contiguous buffer (memory bandwidth: what any collation must at least pay);
  ours      collate_padded_routes: one allocation, each route region copied once, only
            padding rows filled with the dummy route, plus the padding mask;
  baseline  prefill-then-overwrite: fill the whole buffer with the dummy route, set the whole
            mask, then copy every trajectory's routes over it.
  reused    ours writing into the output of an earlier call (`out=`), as a trainer that keeps
            its buffer across steps does: no page faults, only the copy.
Single-threaded (torch.set_num_threads(1)); the floor is also measured with 2 threads to show
whether threads pay on this machine. Median of --repeats, interleaved.

Run: .venv-train/bin/python bench/route_collation.py [--sizes 0.4 1.6 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import numpy as np
import torch

from art_megatron_ext.routing.collate import collate_padded_routes

SEQ_LEN, LAYERS, TOPK = 8192, 48, 8
ROW_BYTES = SEQ_LEN * LAYERS * TOPK


def floor(wire: np.ndarray) -> torch.Tensor:
    out = torch.empty(wire.nbytes, dtype=torch.uint8)
    out.copy_(torch.from_numpy(wire))
    return out


def ours(routes, counts, out=None):
    return collate_padded_routes(
        routes, counts, seq_len=SEQ_LEN, num_layers=LAYERS, topk=TOPK, out=out
    )


def baseline(routes, counts) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty((len(counts), SEQ_LEN, LAYERS, TOPK), dtype=torch.uint8)
    out.copy_(torch.arange(TOPK, dtype=torch.uint8).expand_as(out))
    mask = torch.ones((len(counts), SEQ_LEN), dtype=torch.bool)
    for row, (array, count) in enumerate(zip(routes, counts, strict=True)):
        out[row, :count].copy_(torch.from_numpy(array))
        mask[row, :count] = False
    return out, mask


def _time(fn) -> float:
    gc.collect()
    start = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - start
    del result
    return elapsed


def bench_size(size_gb: float, repeats: int, rng) -> dict[str, float]:
    rows = max(1, round(size_gb * 1e9 / ROW_BYTES))
    counts = rng.integers(SEQ_LEN // 2, SEQ_LEN + 1, size=rows).tolist()
    wire = np.empty(rows * ROW_BYTES, dtype=np.uint8)
    wire[:] = rng.integers(0, 128, size=1 << 20, dtype=np.uint8).repeat(-(-wire.size // (1 << 20)))[
        : wire.size
    ]
    routes, offset = [], 0
    for count in counts:
        routes.append(wire[offset : offset + count * LAYERS * TOPK].reshape(count, LAYERS, TOPK))
        offset += count * LAYERS * TOPK
    check = ours(routes, counts)
    assert torch.equal(check.routes[0, : counts[0]], torch.from_numpy(routes[0]))
    del check
    times: dict[str, list[float]] = {"floor": [], "floor 2 threads": [], "ours": [], "baseline": []}
    for _ in range(repeats):
        torch.set_num_threads(1)
        times["floor"].append(_time(lambda: floor(wire)))
        times["ours"].append(_time(lambda: ours(routes, counts)))
        times["baseline"].append(_time(lambda: baseline(routes, counts)))
        torch.set_num_threads(2)
        times["floor 2 threads"].append(_time(lambda: floor(wire)))
        torch.set_num_threads(1)
    # Reused output (a trainer keeping last step's buffer): measured after the fresh runs so
    # only two buffers (wire + output) are alive at once.
    buffer = ours(routes, counts)
    times["ours, reused buffer"] = [
        _time(lambda b=buffer: ours(routes, counts, out=b)) for _ in range(repeats)
    ]
    del buffer
    return {name: statistics.median(values) for name, values in times.items()} | {
        "bytes": rows * ROW_BYTES
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.4, 1.6, 4.0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(
        f"{'size GB':>8} {'floor s':>8} {'floor 2t s':>10} {'ours s':>8} {'baseline s':>10} "
        f"{'ours/floor':>10} {'baseline/ours':>13} {'reused s':>8} {'baseline/reused':>15}"
    )
    for size in args.sizes:
        t = bench_size(size, args.repeats, rng)
        print(
            f"{t['bytes'] / 1e9:8.2f} {t['floor']:8.3f} {t['floor 2 threads']:10.3f} "
            f"{t['ours']:8.3f} {t['baseline']:10.3f} {t['ours'] / t['floor']:9.2f}x "
            f"{t['baseline'] / t['ours']:12.2f}x {t['ours, reused buffer']:8.3f} "
            f"{t['baseline'] / t['ours, reused buffer']:14.2f}x"
        )


if __name__ == "__main__":
    main()
