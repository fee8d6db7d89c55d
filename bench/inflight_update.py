"""In-flight LoRA updates: latency, and generation throughput under updates, against stock vLLM.

Runs in `.venv-serve` on the tiny model (`make tiny` first), one run, same server settings:

1. update latency over N updates (HTTP round trip and in-engine time), p50 / p99;
2. generation throughput (tokens/s, C concurrent clients) with an update every 0.5 s, against
   the same load with no updates (goal >= 0.95);
3. the same update schedule on stock vLLM through `/v1/load_lora_adapter` with
   `load_inplace: true` (the baseline a user has without the plugin): ratio of throughputs;
4. throughput with the plugin selected against stock vLLM without it, no updates (goal >= 0.98).

Usage: .venv-serve/bin/python bench/inflight_update.py [--seconds 8] [--rounds 3] [--updates 100]
Table values are medians over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import httpx

from art_vllm_plugin import serve_process

TINY = Path(".cache/tiny")
PROMPT = "the policy model learns from the reward and the trainer sends"


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


async def load(url: str, seconds: float, clients: int, update_every: float | None, update_fn):
    """C clients generate 64-token completions for `seconds`; returns (tokens/s, updates)."""
    stop = time.monotonic() + seconds
    tokens = 0
    updates = 0
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:

        async def client(i: int):
            nonlocal tokens
            j = 0
            while time.monotonic() < stop:
                resp = await http.post(
                    "/v1/completions",
                    json={
                        "model": "policy",
                        "prompt": f"{PROMPT} {i} {j}",
                        "max_tokens": 64,
                        "temperature": 0.8,
                        "ignore_eos": True,
                    },
                )
                resp.raise_for_status()
                tokens += resp.json()["usage"]["completion_tokens"]
                j += 1

        async def updater():
            nonlocal updates
            while update_every and time.monotonic() < stop:
                await asyncio.sleep(update_every)
                await update_fn(http, updates)
                updates += 1

        t0 = time.monotonic()
        await asyncio.gather(*(client(i) for i in range(clients)), updater())
        elapsed = time.monotonic() - t0
    return tokens / elapsed, updates


def adapters() -> list[Path]:
    return [TINY / "adapters" / n for n in ("a", "b", "c")]


def plugin_updater(start_version: int):
    async def update(http, k):
        resp = await http.post(
            "/art/v1/lora/update",
            json={
                "slot": "policy",
                "path": str(adapters()[k % 3].resolve()),
                "version": start_version + k,
            },
        )
        resp.raise_for_status()

    return update


async def stock_updater(http, k):
    resp = await http.post(
        "/v1/load_lora_adapter",
        json={
            "lora_name": "policy",
            "lora_path": str(adapters()[k % 3].resolve()),
            "load_inplace": True,
        },
    )
    resp.raise_for_status()


async def latency(url: str, n: int, start_version: int):
    http_ms, engine_ms = [], []
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for k in range(n):
            t0 = time.perf_counter()
            resp = await http.post(
                "/art/v1/lora/update",
                json={
                    "slot": "policy",
                    "path": str(adapters()[k % 3].resolve()),
                    "version": start_version + k,
                },
            )
            http_ms.append((time.perf_counter() - t0) * 1000)
            resp.raise_for_status()
            engine_ms.append(resp.json()["engine_ms"])
    return http_ms, engine_ms


def config(plugin: bool) -> serve_process.ServeConfig:
    return serve_process.ServeConfig(
        model=str(TINY / "model"),
        args=(
            *serve_process.tiny_lora_args(),
            "--lora-modules",
            f"policy={(TINY / 'adapters' / 'a').resolve()}",
        ),
        plugin=plugin,
        env={} if plugin else {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
        log_path=Path(f".cache/logs/bench-inflight-{'art' if plugin else 'stock'}.log"),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--updates", type=int, default=100)
    parser.add_argument("--every", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    run = asyncio.run
    print(
        f"[bench] starting the plugin server and a stock server (both stay up; phases are "
        f"interleaved over {args.rounds} rounds so machine noise hits both alike)"
    )
    with (
        serve_process.serving(config(plugin=True)) as art,
        serve_process.serving(config(plugin=False)) as stock,
    ):
        for srv in (art, stock):
            run(load(srv.url, 3, args.clients, None, None))  # warm-up
        http_ms, engine_ms = run(latency(art.url, args.updates, 1))
        seen = {"art_idle": [], "art_upd": [], "stock_idle": [], "stock_upd": []}
        n_art = n_stock = 0
        version = 10_000
        for r in range(args.rounds):
            print(f"[bench] round {r + 1}/{args.rounds}: 4 phases of {args.seconds:.0f}s")
            seen["art_idle"].append(run(load(art.url, args.seconds, args.clients, None, None))[0])
            seen["stock_idle"].append(
                run(load(stock.url, args.seconds, args.clients, None, None))[0]
            )
            tps, n = run(
                load(art.url, args.seconds, args.clients, args.every, plugin_updater(version))
            )
            seen["art_upd"].append(tps)
            n_art += n
            version += 1000
            tps, n = run(load(stock.url, args.seconds, args.clients, args.every, stock_updater))
            seen["stock_upd"].append(tps)
            n_stock += n
    art_idle, art_upd, stock_idle, stock_upd = (
        statistics.median(seen[k]) for k in ("art_idle", "art_upd", "stock_idle", "stock_upd")
    )
    rows = [
        (
            "update latency, HTTP round trip",
            f"p50 {statistics.median(http_ms):.1f} ms",
            f"p99 {pct(http_ms, 0.99):.1f} ms",
        ),
        (
            "update latency, in engine",
            f"p50 {statistics.median(engine_ms):.2f} ms",
            f"p99 {pct(engine_ms, 0.99):.2f} ms",
        ),
        (
            "art: tok/s no updates / with updates",
            f"{art_idle:.0f} / {art_upd:.0f}",
            f"ratio {art_upd / art_idle:.3f} ({n_art} updates; goal >= 0.95)",
        ),
        (
            "stock: tok/s no updates / load_inplace",
            f"{stock_idle:.0f} / {stock_upd:.0f}",
            f"ratio {stock_upd / stock_idle:.3f} ({n_stock} updates)",
        ),
        ("art with updates / stock with load_inplace", "", f"ratio {art_upd / stock_upd:.3f}"),
        (
            "art selected / stock, no updates",
            "",
            f"ratio {art_idle / stock_idle:.3f} (goal >= 0.98)",
        ),
    ]
    print("\n| measure | value | ratio |\n| --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
