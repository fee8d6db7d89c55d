"""Fleet publish latency to 1, 2 and 3 replicas, and throughput under updates on a DP=2 server.

Runs in `.venv-serve` on the tiny model (`make tiny` first):

1. three `vllm serve --plugin art` replicas (started together, `--max-num-seqs 4`);
2. publish latency (wall time of one `Fleet.publish`, every replica answered), p50 / p99, to 1,
   2 and 3 replicas, against the baseline of one plain `ArtClient.update` to one replica; the
   four kinds are interleaved over the rounds so that load drift on a shared host hits all;
3. with `--dp 2`: one server with `--data-parallel-size 2`: `Fleet.publish` latency to it
   (both engines, two-phase), and generation throughput (C clients, 64-token completions)
   with an update every 0.5 s against the same load with no updates, interleaved over rounds.
   Without `--dp` the DP phase is not run and the table says so.

The replicas share the host's cores: latency to k replicas includes k servers competing for
the same 2 CPUs, which a real fleet (one machine per replica) does not have.

Usage: .venv-serve/bin/python bench/fleet_publish.py [--publishes 30] [--rounds 3]
       [--dp 2 --seconds 8 --clients 4]
Table values are medians over the rounds where a ratio is shown.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from completion_load import generate_until

from art_protocol.client import ArtClient, Fleet, FleetConfig, RetryPolicy
from art_protocol.digest import digest_dir
from art_vllm_plugin import serve_process

TINY = Path(".cache/tiny")
PROMPT = "the policy model learns from the reward and the trainer sends"
RETRY = RetryPolicy(deadline_s=300.0, attempt_timeout_s=300.0)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def serve_config(
    extra: tuple[str, ...] = (), log: str = "fleet", env: dict | None = None
) -> serve_process.ServeConfig:
    return serve_process.ServeConfig(
        model=str(TINY / "model"),
        args=(
            *serve_process.tiny_lora_args(),
            *serve_process.ALLOW_UNAUTHENTICATED,  # loopback, no key: updates allowed
            "--max-num-seqs",
            "4",
            "--lora-modules",
            f"policy={TINY / 'adapters' / 'a'}",
            *extra,
        ),
        log_path=Path(f".cache/logs/bench-{log}.log"),
        env=env or {},
        startup_timeout_s=900.0,  # several servers importing vLLM on 2 shared cores
    )


def start_all(configs: list[serve_process.ServeConfig]) -> list[serve_process.ServerProcess]:
    with ThreadPoolExecutor(len(configs)) as pool:
        futures = [pool.submit(serve_process.start, c) for c in configs]
    servers, errors = [], []
    for f in futures:
        try:
            servers.append(f.result())
        except Exception as exc:
            errors.append(exc)
    if errors:
        for s in servers:
            s.stop()
        raise errors[0]
    return servers


class Versions:
    """One increasing version counter for every replica (any subset may publish next)."""

    def __init__(self):
        self._next = itertools.count(1)
        self.adapters = [TINY / "adapters" / n for n in ("a", "b")]
        self.digests = {p: digest_dir(p) for p in self.adapters}

    def next(self) -> tuple[int, Path, str]:
        v = next(self._next)
        path = self.adapters[v % 2]
        return v, path, self.digests[path]


def publish_latencies(urls: list[str], n_publishes: int, rounds: int, versions: Versions):
    """kind -> publish wall times (ms); kinds: direct (one ArtClient.update), fleet-1/2/3."""
    fleets = {k: Fleet(urls[:k], config=FleetConfig(retry=RETRY)) for k in (1, 2, 3)}
    direct = ArtClient(urls[0], timeout=300)
    out: dict[str, list[float]] = {"direct": [], "fleet-1": [], "fleet-2": [], "fleet-3": []}
    try:
        per_round = max(1, n_publishes // rounds)
        kinds = list(out)
        for r in range(-1, rounds):  # round -1 warms every path up and is not recorded
            for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:  # rotate the order
                for _ in range(per_round if r >= 0 else 1):
                    v, path, digest = versions.next()
                    t0 = time.perf_counter()
                    if kind == "direct":
                        direct.update("policy", str(path), v)
                    else:
                        res = fleets[int(kind[-1])].publish("policy", str(path), v, digest=digest)
                        if not res.ok:
                            raise RuntimeError(f"publish {v} failed: {res.failed}")
                    if r >= 0:
                        out[kind].append((time.perf_counter() - t0) * 1000.0)
    finally:
        direct.close()
        for f in fleets.values():
            f.close()
    return out


async def load(url: str, seconds: float, clients: int, update_every, publish) -> tuple[float, int]:
    """C clients generate 64-token completions for `seconds`; returns (tokens/s, updates)."""
    stop = time.monotonic() + seconds
    updates = 0
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:

        async def updater():
            nonlocal updates
            while update_every and time.monotonic() < stop:
                await asyncio.sleep(update_every)
                await asyncio.to_thread(publish)
                updates += 1

        t0 = time.monotonic()
        tokens, _ = await asyncio.gather(generate_until(http, stop, clients, PROMPT), updater())
        elapsed = time.monotonic() - t0
    return tokens / elapsed, updates


def dp_phase(args, versions: Versions) -> dict:
    cpus = sorted(os.sched_getaffinity(0))
    # One OpenMP core per engine's worker (vLLM cannot pick NUMA nodes for DP on this host).
    bind = "|".join(str(cpus[i % len(cpus)]) for i in range(args.dp))
    config = serve_config(
        ("--data-parallel-size", str(args.dp)),
        log=f"dp{args.dp}",
        env={"VLLM_CPU_OMP_THREADS_BIND": bind},
    )
    with (
        serve_process.serving(config) as srv,
        Fleet([srv.url], config=FleetConfig(retry=RETRY)) as fleet,
    ):

        def publish():
            v, path, digest = versions.next()
            res = fleet.publish("policy", str(path), v, digest=digest)
            if not res.ok:
                raise RuntimeError(f"publish {v} to DP={args.dp} failed: {res.failed}")
            engines = len(res.replicas[0].response.get("receipts", []))
            if engines != args.dp:
                raise RuntimeError(f"publish {v}: {engines} receipts, expected {args.dp}")
            return res

        lat = []
        for _ in range(args.publishes):
            t0 = time.perf_counter()
            publish()
            lat.append((time.perf_counter() - t0) * 1000.0)
        ratios, with_upd, without = [], [], []
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            got = {}
            for updating in order:
                got[updating] = asyncio.run(
                    load(srv.url, args.seconds, args.clients, 0.5 if updating else None, publish)
                )
            with_upd.append(got[True][0])
            without.append(got[False][0])
            ratios.append(got[True][0] / got[False][0])
    return {"latency": lat, "with": with_upd, "without": without, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--publishes", type=int, default=30, help="publishes per kind")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dp", type=int, default=0, help="data-parallel size of the DP phase")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()
    versions = Versions()

    servers = start_all([serve_config(log=f"fleet-{i}") for i in range(3)])
    try:
        lat = publish_latencies([s.url for s in servers], args.publishes, args.rounds, versions)
    finally:
        for s in servers:
            s.stop()
    base = statistics.median(lat["direct"])
    print("| publish to | n | p50 ms | p99 ms | p50 / direct |")
    print("| --- | --- | --- | --- | --- |")
    for kind, values in lat.items():
        p50 = statistics.median(values)
        print(
            f"| {kind} | {len(values)} | {p50:.1f} | {pct(values, 0.99):.1f} | {p50 / base:.2f} |"
        )

    if not args.dp:
        print("DP phase not run (pass --dp 2 where `--data-parallel-size 2` runs)")
        return
    dp = dp_phase(args, Versions())  # a fresh server: its slot starts at version 0
    print(
        f"| DP={args.dp} fleet publish (direct measured minutes earlier) | {len(dp['latency'])} | "
        f"{statistics.median(dp['latency']):.1f} | {pct(dp['latency'], 0.99):.1f} | "
        f"{statistics.median(dp['latency']) / base:.2f} |"
    )
    print(
        f"DP={args.dp} throughput with an update every 0.5 s / none: median ratio "
        f"{statistics.median(dp['ratios']):.3f} (rounds {[round(r, 3) for r in dp['ratios']]}; "
        f"tok/s with {[round(x) for x in dp['with']]}, without {[round(x) for x in dp['without']]})"
    )


if __name__ == "__main__":
    main()
