"""Benchmark: the cost of serving MoE routes (issue 15, part 5).

1. Capture overhead: generation throughput of the tiny Qwen3-MoE served with `--art-routes`
   (requests through `/art/v1/completions` with `return_routes`, routes decoded by the client)
   against the same server configuration without `--art-routes` (plain `/v1/completions`),
   same load: --concurrency requests of --max-tokens tokens (ignore_eos), --rounds rounds.
   Both servers run at once and the rounds alternate (base, routes, base, ...), so each pair
   of rounds sees the same load on a shared host; the median per-pair ratio is reported.
   Goal: routes / base >= 0.95.
2. Transport, for the same routes: bytes per route-bearing token and server encode + client
   decode time of
   - ours: route bundle + `application/vnd.art.routes` body (server) and
     `decode_routed_completion` (client: numpy views, no copy);
   - vLLM's field: `numpy2base64` (`.npy` bytes, base64) per choice inside the JSON, decoded by
     `json.loads` + base64 + `np.load`;
   - the floor: one copy of the raw route bytes.
   On the routes the server returned in step 1, and on a synthetic production shape
   (--traj trajectories x 2048 tokens x 48 layers x top-8, 128 experts).

Run: .venv-serve/bin/python bench/route_capture.py [--rounds 4] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import gc
import io
import json
import statistics
import time
from pathlib import Path

import httpx
import numpy as np

from art_protocol.client.routes import decode_routed_completion
from art_protocol.route_bundle import encode_route_bundle
from art_protocol.routed_completion import encode_head
from art_vllm_plugin import serve_process

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / ".cache" / "tiny" / "moe"


def _args(routes: bool) -> tuple[str, ...]:
    args = ("--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "1024")
    return (*args, "--art-routes") if routes else args


async def _round(url: str, routes: bool, args, seed: int) -> tuple[int, float, list]:
    rng = np.random.default_rng(seed)
    path = "/art/v1/completions" if routes else "/v1/completions"

    async def one(client, i):
        body = {
            "model": str(MODEL),
            "prompt": rng.integers(3, 500, args.prompt_tokens).tolist(),
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
            "temperature": 1.0,
            "seed": seed * 1000 + i,
        }
        if routes:
            body["return_routes"] = True
        resp = await client.post(url + path, json=body, timeout=600)
        resp.raise_for_status()
        if routes:
            routed = decode_routed_completion(resp.content)
            return routed.completion["usage"]["completion_tokens"], routed
        return resp.json()["usage"]["completion_tokens"], None

    async with httpx.AsyncClient() as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client, i) for i in range(args.concurrency)))
        elapsed = time.perf_counter() - start
    return sum(tokens for tokens, _ in results), elapsed, [r for _, r in results]


def throughput(args, log_dir: Path) -> tuple[list[float], list[float], list]:
    """Both servers up at once; rounds alternate base, routes, base, routes, ... so each pair
    of rounds sees the same host load. Returns the per-round tok/s of each and the last
    round's decoded routed completions."""
    configs = [
        serve_process.ServeConfig(
            model=str(MODEL),
            args=_args(routes),
            log_path=log_dir / f"route_capture_{'routes' if routes else 'base'}.log",
        )
        for routes in (False, True)
    ]
    base_rates, route_rates, last = [], [], []
    with serve_process.serving(configs[0]) as base, serve_process.serving(configs[1]) as routed:
        for srv, routes in ((base, False), (routed, True)):
            asyncio.run(_round(srv.url, routes, args, seed=999))  # warm-up
        for r in range(args.rounds):
            for srv, routes, rates in ((base, False, base_rates), (routed, True, route_rates)):
                tokens, elapsed, results = asyncio.run(_round(srv.url, routes, args, seed=r))
                rates.append(tokens / elapsed)
                if routes:
                    last = results
    return base_rates, route_rates, last


def _median(fn, repeats):
    times, out = [], None
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def _vllm_field_encode(routes, completion):
    from vllm.utils.serial_utils import numpy2base64

    pairs = zip(completion, routes, strict=True)
    choices = [dict(c, routed_experts=numpy2base64(r)) for c, r in pairs]
    return json.dumps({"choices": choices}).encode()


def _vllm_field_decode(data):
    choices = json.loads(data)["choices"]
    return [np.load(io.BytesIO(base64.b64decode(c["routed_experts"]))) for c in choices]


def transport(routes: list[np.ndarray], num_experts: int, repeats: int) -> dict:
    """Bytes per token and encode+decode seconds of ours, vLLM's field, and the floor."""
    tokens = sum(len(r) for r in routes)
    raw = sum(r.nbytes for r in routes)
    completion = [{"index": i, "routes": {"rows": len(r)}} for i, r in enumerate(routes)]

    def ours_encode():  # what the server does: the head and the bundle go out as two writes
        bundle = encode_route_bundle(routes, num_experts=num_experts)
        return encode_head({"choices": completion}, len(bundle)), bundle

    enc, (head, bundle) = _median(ours_encode, repeats)
    body = head + bytes(bundle)  # what the client receives
    dec, decoded = _median(lambda: decode_routed_completion(body), repeats)
    assert all(np.array_equal(a, b) for a, b in zip(routes, decoded.routes, strict=True))
    json_bytes = len(json.dumps({"choices": completion}))
    ours_route_bytes = len(body) - json_bytes

    v_enc, field = _median(lambda: _vllm_field_encode(routes, completion), repeats)
    v_dec, back = _median(lambda: _vllm_field_decode(field), repeats)
    assert all(np.array_equal(a, b) for a, b in zip(routes, back, strict=True))
    field_route_bytes = len(field) - json_bytes

    flat = [np.ascontiguousarray(r) for r in routes]

    def floor_copy():  # a fresh buffer, as any sender needs, and one copy of the bytes
        out = bytearray(raw)
        view = np.frombuffer(out, dtype=np.uint8)
        cursor = 0
        for r in flat:
            n = r.nbytes
            view[cursor : cursor + n] = r.reshape(-1).view(np.uint8)
            cursor += n
        return out

    floor, _ = _median(floor_copy, repeats)
    return {
        "tokens": tokens,
        "raw_bytes_per_token": raw / tokens,
        "ours_bytes_per_token": ours_route_bytes / tokens,
        "vllm_bytes_per_token": field_route_bytes / tokens,
        "ours_s": enc + dec,
        "ours_encode_s": enc,
        "ours_decode_s": dec,
        "vllm_s": v_enc + v_dec,
        "floor_s": floor,
    }


def _fmt(name: str, t: dict) -> str:
    return (
        f"{name}: {t['tokens']} tokens; bytes/token ours {t['ours_bytes_per_token']:.2f}, "
        f"vLLM base64 field {t['vllm_bytes_per_token']:.2f}, floor {t['raw_bytes_per_token']:.2f} "
        f"(ours/floor {t['ours_bytes_per_token'] / t['raw_bytes_per_token']:.3f}x, "
        f"vLLM/ours {t['vllm_bytes_per_token'] / t['ours_bytes_per_token']:.3f}x); "
        f"encode+decode ours {t['ours_s'] * 1e3:.2f} ms (enc {t['ours_encode_s'] * 1e3:.2f}, "
        f"dec {t['ours_decode_s'] * 1e3:.2f}), vLLM {t['vllm_s'] * 1e3:.2f} ms, floor "
        f"{t['floor_s'] * 1e3:.2f} ms (ours/floor {t['ours_s'] / t['floor_s']:.2f}x, "
        f"vLLM/ours {t['vllm_s'] / t['ours_s']:.2f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--traj", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-servers", action="store_true")
    parser.add_argument("--log-dir", type=Path, default=REPO / ".cache" / "logs")
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)

    if not args.skip_servers:
        base_rates, route_rates, routed = throughput(args, args.log_dir)
        ratios = [r / b for r, b in zip(route_rates, base_rates, strict=True)]
        print(
            f"throughput tok/s per round: base {[round(x, 1) for x in base_rates]}, routes "
            f"{[round(x, 1) for x in route_rates]}; routes/base per pair "
            f"{[round(x, 3) for x in ratios]}, median {statistics.median(ratios):.3f}, "
            f"totals {sum(route_rates) / sum(base_rates):.3f}"
        )
        served = [np.array(r.routes[0]) for r in routed]
        print(_fmt("served routes", transport(served, routed[0].num_experts, args.repeats)))

    rng = np.random.default_rng(0)
    big = [rng.integers(0, 128, (2048, 48, 8), dtype=np.uint8) for _ in range(args.traj)]
    print(_fmt(f"synthetic {args.traj}x2048x48x8", transport(big, 128, args.repeats)))


if __name__ == "__main__":
    main()
