"""`/art/metrics` against Prometheus `/metrics`: latency p50/p99 and bytes, idle and under load.

One server (`vllm serve --plugin art` on the tiny model), both routes polled alternately in the
same run so machine noise hits both alike. "Under load" means C clients generating meanwhile.
Goal: `/art/metrics` at least 20x faster than `/metrics` at p50.

Usage: .venv-serve/bin/python bench/metrics_route.py [--samples 300] [--clients 4]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import statistics
import time
from pathlib import Path

import httpx

from art_vllm_plugin import serve_process

TINY = Path(".cache/tiny")
ROUTES = ("/art/metrics", "/metrics")


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def poll(url: str, samples: int) -> dict[str, tuple[list[float], int]]:
    """Alternate the two routes over one keep-alive connection (`http.client`: the client's
    own overhead is a few microseconds, so the numbers are mostly the server's)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    out = {r: ([], 0) for r in ROUTES}
    try:
        for _ in range(samples):
            for route in ROUTES:
                t0 = time.perf_counter()
                conn.request("GET", route)
                resp = conn.getresponse()
                body = resp.read()
                ms = (time.perf_counter() - t0) * 1000
                if resp.status != 200:
                    raise RuntimeError(f"{route}: HTTP {resp.status}: {body[:200]!r}")
                out[route][0].append(ms)
                out[route] = (out[route][0], len(body))
    finally:
        conn.close()
    return out


async def under_load(url: str, samples: int, clients: int):
    stop = asyncio.Event()

    async def client(i):
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            while not stop.is_set():
                await http.post(
                    "/v1/completions",
                    json={
                        "model": "policy",
                        "prompt": f"the policy {i}",
                        "max_tokens": 64,
                        "ignore_eos": True,
                    },
                )

    tasks = [asyncio.create_task(client(i)) for i in range(clients)]
    await asyncio.sleep(1.0)
    result = await asyncio.to_thread(poll, url, samples)
    stop.set()
    await asyncio.gather(*tasks)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()
    config = serve_process.ServeConfig(
        model=str(TINY / "model"),
        args=(
            *serve_process.tiny_lora_args(),
            "--lora-modules",
            f"policy={TINY / 'adapters' / 'a'}",
        ),
        log_path=Path(".cache/logs/bench-metrics.log"),
    )
    with serve_process.serving(config) as srv:
        poll(srv.url, 20)  # warm-up
        phases = {
            "idle": poll(srv.url, args.samples),
            "under load": asyncio.run(under_load(srv.url, args.samples, args.clients)),
        }
    print("\n| phase | route | p50 ms | p99 ms | bytes | p50 ratio /metrics : /art/metrics |")
    print("| --- | --- | --- | --- | --- | --- |")
    for phase, res in phases.items():
        p50 = {r: statistics.median(res[r][0]) for r in ROUTES}
        for route in ROUTES:
            ratio = f"{p50['/metrics'] / p50['/art/metrics']:.1f}x" if route == ROUTES[0] else ""
            print(
                f"| {phase} | {route} | {p50[route]:.2f} | {pct(res[route][0], 0.99):.2f} | "
                f"{res[route][1]} | {ratio} |"
            )


if __name__ == "__main__":
    main()
