"""CPU core layout (`--art-cpu-layout`): API-server responsiveness during generation.

On a CPU host with few cores the worker takes a core and EngineCore's spin-wait shares the
other with the API server. This runs the same load on the same tiny model twice, with
`--art-cpu-layout off` (vLLM's own layout, the baseline) and `auto` (EngineCore shares the
worker's core), and reports for each:

- `/health` latency, polled every 20 ms by a separate thread while C clients generate;
- `/art/v1/lora/update` latency during the same generation (one update every 0.5 s);
- generation tokens/s of the clients (the cost of the layout, if any);
- the CPUs each process's threads may use.

Ratios are auto / off from the same run. Rounds alternate off, auto, off, auto, ... so a
busy neighbour on a shared host hits both.

Usage: .venv-serve/bin/python bench/cpu_layout.py [--seconds 10] [--clients 2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from pathlib import Path

import httpx
import psutil
from completion_load import generate_until

from art_vllm_plugin import serve_process

TINY = Path(".cache/tiny")
PROMPT = "the policy model learns from the reward and the trainer sends"


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))] if values else float("nan")


def poll_health(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(base_url=url, timeout=60) as http:
        while not stop.is_set():
            t0 = time.perf_counter()
            http.get("/health").raise_for_status()
            out.append((time.perf_counter() - t0) * 1000.0)
            time.sleep(0.02)


async def generate_and_update(url: str, seconds: float, clients: int, adapters, version0: int):
    stop_at = time.monotonic() + seconds
    update_ms: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:

        async def updater():
            k = 0
            while time.monotonic() < stop_at - 0.5:
                await asyncio.sleep(0.5)
                k += 1
                t0 = time.perf_counter()
                resp = await http.post(
                    "/art/v1/lora/update",
                    json={
                        "slot": "policy",
                        "path": str(adapters[k % len(adapters)]),
                        "version": version0 + k,
                    },
                )
                resp.raise_for_status()
                update_ms.append((time.perf_counter() - t0) * 1000.0)
            return version0 + k

        t0 = time.monotonic()
        tokens, last_version = await asyncio.gather(
            generate_until(http, stop_at, clients, PROMPT, max_tokens=128), updater()
        )
        elapsed = time.monotonic() - t0
    return tokens / elapsed, update_ms, last_version


def affinities(server) -> dict[str, list[int]]:
    out = {"api_server": sorted(psutil.Process(server.proc.pid).cpu_affinity())}
    for child in psutil.Process(server.proc.pid).children(recursive=True):
        cpus = set()
        for thread in child.threads():
            try:
                cpus |= set(psutil.Process(thread.id).cpu_affinity())
            except psutil.Error:
                continue
        out[child.name()] = sorted(cpus)
    return out


def run(layout: str, seconds: float, clients: int) -> dict:
    adapters = [(TINY / "adapters" / n).resolve() for n in ("a", "b", "c")]
    config = serve_process.ServeConfig(
        model=str(TINY / "model"),
        args=(
            *serve_process.tiny_lora_args(),
            *serve_process.ALLOW_UNAUTHENTICATED,  # loopback, no key: updates allowed
            "--lora-modules",
            f"policy={adapters[0]}",
            "--art-cpu-layout",
            layout,
        ),
        log_path=Path(f".cache/logs/bench-cpu-layout-{layout}.log"),
    )
    with serve_process.serving(config) as server:
        httpx.post(
            server.url + "/v1/completions",
            json={"model": "policy", "prompt": PROMPT, "max_tokens": 16},
            timeout=300,
        ).raise_for_status()
        health: list[float] = []
        stop = threading.Event()
        poller = threading.Thread(target=poll_health, args=(server.url, stop, health))
        poller.start()
        try:
            tok_s, update_ms, _ = asyncio.run(
                generate_and_update(server.url, seconds, clients, adapters, 1)
            )
        finally:
            stop.set()
            poller.join()
        return {
            "layout": layout,
            "health": health,
            "update": update_ms,
            "tok_s": tok_s,
            "cpus": affinities(server),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {"off": [], "auto": []}
    for _ in range(args.rounds):
        for layout in ("off", "auto"):
            r = run(layout, args.seconds, args.clients)
            results[layout].append(r)
            print(f"{layout}: cpus {r['cpus']}", flush=True)
    rows = {}
    for layout, runs in results.items():
        health = [x for r in runs for x in r["health"]]
        update = [x for r in runs for x in r["update"]]
        rows[layout] = {
            "health_p50": pct(health, 0.5),
            "health_p99": pct(health, 0.99),
            "health_max": max(health),
            "update_p50": pct(update, 0.5),
            "update_p99": pct(update, 0.99),
            "tok_s": statistics.median(r["tok_s"] for r in runs),
            "n_health": len(health),
        }
    print(f"\nload average {psutil.getloadavg()}; {psutil.cpu_count()} CPUs")
    print("| layout | /health p50 ms | p99 ms | max ms | update p50 ms | p99 ms | tok/s | polls |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for layout, row in rows.items():
        print(
            f"| {layout} | {row['health_p50']:.1f} | {row['health_p99']:.1f} | "
            f"{row['health_max']:.1f} | {row['update_p50']:.1f} | {row['update_p99']:.1f} | "
            f"{row['tok_s']:.0f} | {row['n_health']} |"
        )
    off, auto = rows["off"], rows["auto"]
    print(
        f"\nauto / off: /health p99 {auto['health_p99'] / off['health_p99']:.3f}, "
        f"max {auto['health_max'] / off['health_max']:.3f}, "
        f"update p99 {auto['update_p99'] / off['update_p99']:.3f}, "
        f"tok/s {auto['tok_s'] / off['tok_s']:.3f}"
    )


if __name__ == "__main__":
    main()
