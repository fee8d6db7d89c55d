"""In-flight LoRA updates: engine stall, latency, and throughput under updates, against stock vLLM.

Runs in `.venv-serve` on the tiny model (`make tiny` first):

1. engine stall per update, from EngineCore's own timestamps (`/art/v1/engine` `stalls_ms`:
   the time the step loop was held by the update's utility calls, stage + commit), p50 / p99,
   next to the mean engine step time of the same run, under load (C clients), for the tiny
   adapter (r=8) and one 32x larger (r=256, `--max-lora-rank 256`; written once to
   `.cache/bench-adapters/`). Goal: p50 <= 1 ms for both;
2. update latency over N updates (HTTP round trip), p50 / p99;
3. generation throughput (tokens/s, C concurrent clients) with an update every 0.5 s, against
   the same load with no updates (goal >= 0.95), phases interleaved over the rounds;
4. the same update schedule on stock vLLM through `/v1/load_lora_adapter` with
   `load_inplace: true` (the baseline a user has without the plugin): ratio of throughputs;
5. throughput with the plugin selected against stock vLLM without it, no updates (goal >= 0.98).

The plugin and stock servers are up together and their phases alternate within each round
(plugin idle, stock idle, plugin with updates, stock with updates), so every ratio compares
periods seconds apart on the same host, not the host's load minutes apart.

`--runner v2` (default) serves on Model Runner V2, what GPUs run; on this CPU build that is
Triton's interpreter (tests/support/model_runner.py; `make test-serve-v2` sets it up), whose
kernels dominate the step time. `--runner v1` serves on the V1 runner the CPU build uses.

Usage: .venv-serve/bin/python bench/inflight_update.py [--runner v2|v1] [--seconds 8]
       [--rounds 3] [--updates 100]
Table values are medians over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx
from completion_load import generate_until

from art_vllm_plugin import serve_process

TINY = Path(".cache/tiny")
PROMPT = "the policy model learns from the reward and the trainer sends"


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


async def load(url: str, seconds: float, clients: int, update_every: float | None, update_fn):
    """C clients generate 64-token completions for `seconds`; returns (tokens/s, updates)."""
    stop = time.monotonic() + seconds
    updates = 0
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:

        async def updater():
            nonlocal updates
            while update_every and time.monotonic() < stop:
                await asyncio.sleep(update_every)
                await update_fn(http, updates)
                updates += 1

        t0 = time.monotonic()
        tokens, _ = await asyncio.gather(generate_until(http, stop, clients, PROMPT), updater())
        elapsed = time.monotonic() - t0
    return tokens / elapsed, updates


def adapters() -> list[Path]:
    return [TINY / "adapters" / n for n in ("a", "b", "c")]


LARGE_RANK = 256
LARGE_DIR = Path(".cache/bench-adapters") / f"r{LARGE_RANK}"


def large_adapters() -> list[Path]:
    """Three r=256 adapters of the tiny model (32x the r=8 files), written once."""
    from art_vllm_plugin.tiny_model import TinyModelConfig, write_adapter

    cfg = TinyModelConfig(lora_rank=LARGE_RANK)
    out = []
    for i, name in enumerate(("a", "b", "c")):
        path = LARGE_DIR / name
        if not (path / "adapter_model.safetensors").exists():
            write_adapter(cfg, TINY / "model", i, path)
        out.append(path)
    return out


def size_of(path: Path) -> int:
    return (path / "adapter_model.safetensors").stat().st_size


async def engine_state(url: str) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        return (await http.get("/art/v1/engine")).json()


async def stall_under_load(url: str, paths: list[Path], n: int, clients: int, start_version: int):
    """n updates 0.1 s apart while C clients generate; returns (stalls ms, mean step ms)."""
    before = len((await engine_state(url))["stalls_ms"])
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        done = asyncio.Event()

        async def client(i: int):
            j = 0
            while not done.is_set():
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
                j += 1

        async def updater():
            await asyncio.sleep(1.0)
            for k in range(n):
                resp = await http.post(
                    "/art/v1/lora/update",
                    json={
                        "slot": "policy",
                        "path": str(paths[k % len(paths)].resolve()),
                        "version": start_version + k,
                    },
                )
                resp.raise_for_status()
                await asyncio.sleep(0.1)
            done.set()

        await asyncio.gather(updater(), *(client(i) for i in range(clients)))
    state = await engine_state(url)
    return state["stalls_ms"][before:], state["commit_stalls_ms"][before:], state["mean_step_ms"]


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
    http_ms, engine_ms = [], []  # engine_ms: the commit call alone
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


def runner_env(runner: str) -> dict[str, str]:
    """The servers' environment for `runner` (the serve suite's own set-up)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support.model_runner import server_env

    return server_env(runner)


def config(
    plugin: bool, runner: str, start: Path | None = None, rank: int = 8
) -> serve_process.ServeConfig:
    start = start or TINY / "adapters" / "a"
    args = list(serve_process.tiny_lora_args())
    args[args.index("--max-lora-rank") + 1] = str(rank)
    env = runner_env(runner)
    if not plugin:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    name = f"{'art' if plugin else 'stock'}-{runner}-r{rank}"
    return serve_process.ServeConfig(
        model=str(TINY / "model"),
        args=(
            *args,
            # loopback, no key: updates allowed (the stock server keeps stock flags)
            *(serve_process.ALLOW_UNAUTHENTICATED if plugin else ()),
            "--lora-modules",
            f"policy={start.resolve()}",
        ),
        plugin=plugin,
        env=env,
        log_path=Path(f".cache/logs/bench-inflight-{name}.log"),
        startup_timeout_s=900,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runner", choices=("v2", "v1"), default="v2")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--updates", type=int, default=100)
    parser.add_argument("--every", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stall-updates", type=int, default=50)
    args = parser.parse_args()
    run = asyncio.run
    big = large_adapters()
    ratio = size_of(big[0]) / size_of(adapters()[0])
    print(f"[bench] r={LARGE_RANK} adapter is {ratio:.0f}x the r=8 adapter's file size")
    stall = {}
    seen = {"art_idle": [], "art_upd": [], "stock_idle": [], "stock_upd": []}
    n_art = n_stock = 0
    print(f"[bench] runner {args.runner}: plugin and stock servers, r=8")
    with (
        serve_process.serving(config(True, args.runner)) as art,
        serve_process.serving(config(False, args.runner)) as stock,
    ):
        run(load(art.url, 3, args.clients, None, None))  # warm-up
        run(load(stock.url, 3, args.clients, None, None))
        stall["r8"] = run(
            stall_under_load(art.url, adapters(), args.stall_updates, args.clients, 1)
        )
        http_ms, engine_ms = run(latency(art.url, args.updates, 1000))
        version = 10_000
        for r in range(args.rounds):
            print(f"[bench] round {r + 1}/{args.rounds}: plugin and stock alternate")
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
    print(f"[bench] plugin server, r={LARGE_RANK}: stall")
    with serve_process.serving(config(True, args.runner, start=big[0], rank=LARGE_RANK)) as art:
        run(load(art.url, 3, args.clients, None, None))
        stall["big"] = run(stall_under_load(art.url, big, args.stall_updates, args.clients, 1))
    art_idle, art_upd, stock_idle, stock_upd = (
        statistics.median(seen[k]) for k in ("art_idle", "art_upd", "stock_idle", "stock_upd")
    )
    rows = []
    for key, label in (("r8", "r=8"), ("big", f"r={LARGE_RANK} ({ratio:.0f}x the bytes)")):
        stalls, commits, step_ms = stall[key]
        rows.append(
            (
                f"engine stall per update, {label}, under load",
                f"p50 {statistics.median(stalls):.2f} ms, p99 {pct(stalls, 0.99):.2f} ms "
                f"({len(stalls)} updates; goal p50 <= 1 ms); of which the commit call p50 "
                f"{statistics.median(commits):.2f} ms",
                f"mean step {step_ms:.2f} ms; "
                f"p50 stall / step {statistics.median(stalls) / step_ms:.2f}",
            )
        )
    rows += [
        (
            "update latency, HTTP round trip",
            f"p50 {statistics.median(http_ms):.1f} ms",
            f"p99 {pct(http_ms, 0.99):.1f} ms",
        ),
        (
            "update commit call, in engine",
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
    print(f"\nmodel runner: {args.runner}")
    print("\n| measure | value | ratio |\n| --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
