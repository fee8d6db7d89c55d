"""Benchmark: route bundle encode + decode against JSON with base64 arrays.

Batch (default): 256 trajectories x 2048 tokens x 48 layers x top-8, 128 experts; the routes
arrive as int32 numpy arrays (what an inference engine hands over). Baseline: the common wire
format, a JSON document with one {"shape", "dtype", "data": base64(raw int32 bytes)} object per
trajectory, decoded with json.loads + b64decode + np.frombuffer. Bundle: encode_route_bundle
(range check + narrowing copy into one buffer) and decode_route_bundle (header checks, expert
id range scan, numpy views). Both sides measured in the same run; median of --repeats.

Run: .venv-train/bin/python bench/route_bundle.py [--trajectories 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import base64
import gc
import json
import statistics
import time

import numpy as np

from art_protocol.route_bundle import decode_route_bundle, encode_route_bundle

LAYERS, TOPK, EXPERTS = 48, 8, 128


def json_encode(routes: list[np.ndarray]) -> bytes:
    items = [
        {"shape": list(a.shape), "dtype": str(a.dtype), "data": base64.b64encode(a).decode()}
        for a in routes
    ]
    return json.dumps({"routes": items}).encode()


def json_decode(data: bytes) -> list[np.ndarray]:
    items = json.loads(data)["routes"]
    return [
        np.frombuffer(base64.b64decode(i["data"]), dtype=i["dtype"]).reshape(i["shape"])
        for i in items
    ]


def _median(fn, repeats):
    times, result = [], None
    for _ in range(repeats):
        result = None
        gc.collect()
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def _round_trip(encode, decode, routes, repeats):
    """Median encode and decode seconds and the encoded size; checks the decoded values."""
    enc, data = _median(encode, repeats)
    dec, decoded = _median(lambda: decode(data), repeats)
    assert all(np.array_equal(a, b) for a, b in zip(routes[:4], decoded[:4], strict=True))
    return enc, dec, len(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trajectories", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    one = rng.integers(0, EXPERTS, size=(args.tokens, LAYERS, TOPK), dtype=np.int32)
    routes = [np.roll(one, i, axis=0) for i in range(args.trajectories)]
    raw = sum(a.nbytes for a in routes)
    print(
        f"{args.trajectories} trajectories x {args.tokens} tokens x {LAYERS} layers x "
        f"top-{TOPK}, {EXPERTS} experts; int32 source {raw / 2**20:.0f} MiB"
    )

    enc_b, dec_b, size_b = _round_trip(
        lambda: encode_route_bundle(routes, num_experts=EXPERTS),
        lambda data: decode_route_bundle(data).routes,
        routes,
        args.repeats,
    )
    enc_j, dec_j, size_j = _round_trip(
        lambda: json_encode(routes), json_decode, routes, args.repeats
    )

    rows = [
        ("json+base64 (baseline)", enc_j, dec_j, size_j),
        ("route bundle", enc_b, dec_b, size_b),
    ]
    print(
        f"{'format':<24} {'encode s':>9} {'decode s':>9} {'total s':>9} {'MiB':>8} "
        f"{'speedup':>8} {'smaller':>8}"
    )
    for name, enc, dec, size in rows:
        print(
            f"{name:<24} {enc:9.3f} {dec:9.3f} {enc + dec:9.3f} {size / 2**20:8.1f} "
            f"{(enc_j + dec_j) / (enc + dec):7.1f}x {size_j / size:7.2f}x"
        )


if __name__ == "__main__":
    main()
