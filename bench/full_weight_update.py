"""Full-weight updates (`POST /art/v1/weights/update`): engine stall, end-to-end time against the
model's bytes, and throughput under periodic updates, against restarting the server.

Runs in `.venv-serve` (`make tiny` first), for the tiny model and one >= 20x larger (hidden
512, intermediate 1024, 4 layers: written once to `.cache/bench-weights/large/model` with the
tiny model's tokenizer):

1. engine stall per update, from EngineCore's own timestamps (`/art/v1/engine` `stalls_ms`:
   the step loop's time in the update's utility calls plus the workers' in-place write at the
   start of the carrying step), p50 / p99, next to the mean engine step, under load (C
   clients generating);
2. end-to-end update time (HTTP round trip: copy to the stage, checks, digest, staging on the
   workers, commit), p50, per model byte size;
3. the baseline a team without the plugin has for new full weights on one host: restart vLLM
   on the new checkpoint (start-up until `/health` answers), timed on the same host; ratio
   restart / update;
4. generation throughput with a full update every `--every` seconds against the same load with
   no updates (phases interleaved over the rounds).

`--transport gloo` streams each version from this process (the trainer) over the `art_gloo`
weight-transfer group instead of naming a directory (`GlooWeightSender`; the server runs
`--weight-transfer-config '{"backend": "art_gloo"}'`): end to end is then the request plus
the stream, and no stage is copied or read from disk. `--transport nixl` streams through
`NixlWeightSender`'s registered buckets, which the worker READs over NIXL (`art_nixl`). Each
row also gives the update's bytes over its end-to-end time against a plain in-process copy
of the same tensors (the memcpy ceiling of this host, measured in the same run).

Usage: .venv-serve/bin/python bench/full_weight_update.py [--runner v1|v2] [--seconds 6]
       [--rounds 2] [--updates 12] [--every 1.0] [--transport files|gloo|nixl]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import httpx
from completion_load import generate_until

# (imported before `config` puts tests/ on sys.path: its art_megatron_ext/ would shadow ours)
from art_megatron_ext.weights import GlooWeightSender, NixlWeightSender
from art_protocol.client import ArtClient
from art_protocol.weight_transfer import GLOO_BACKEND, NIXL_BACKEND
from art_vllm_plugin import serve_process

TINY = Path(".cache/tiny/model")
#: `--transport` -> the server's weight-transfer engine
BACKENDS = {"gloo": GLOO_BACKEND, "nixl": NIXL_BACKEND}
ROOT = Path(".cache/bench-weights")
PROMPT = "the policy model learns from the reward and the trainer sends"
LARGE = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def large_model() -> Path:
    """The >= 20x model (same tokenizer as the tiny one), written once."""
    out = ROOT / "large" / "model"
    if (out / "model.safetensors").exists():
        return out
    from art_vllm_plugin.tiny_model import TOKENIZER_FILES, TinyModelConfig, write_model

    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(TINY / name, out / name)
    vocab = len(__import__("json").loads((TINY / "tokenizer.json").read_text())["model"]["vocab"])
    write_model(TinyModelConfig(**LARGE), vocab, out)
    return out


def exports(model: Path, name: str, count: int) -> list[Path]:
    """`count` trainer exports of `model` with noise (distinct weights), written once."""
    import torch
    from safetensors.torch import load_file, save_file

    base = load_file(str(model / "model.safetensors"))
    out = []
    for k in range(count):
        d = ROOT / name / "exports" / f"v{k}"
        if not (d / "model.safetensors").exists():
            d.mkdir(parents=True, exist_ok=True)
            g = torch.Generator().manual_seed(k)
            noisy = {
                n: (t.float() + 0.01 * torch.randn(t.shape, generator=g)).to(t.dtype)
                for n, t in base.items()
            }
            save_file(noisy, str(d / "model.safetensors"), metadata={"format": "pt"})
        out.append(d.resolve())
    return out


def config(model: Path, runner: str, transport: str = "files") -> serve_process.ServeConfig:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support.model_runner import server_env

    return serve_process.ServeConfig(
        model=str(model.resolve()),
        args=(
            *("--dtype", "bfloat16", "--max-model-len", "512", "--gpu-memory-utilization", "0.2"),
            *("--art-adapter-root", str(ROOT.resolve())),
            *serve_process.ALLOW_UNAUTHENTICATED,
            *(
                ("--weight-transfer-config", json.dumps({"backend": BACKENDS.get(transport)}))
                if transport in BACKENDS
                else ()
            ),
        ),
        env=server_env(runner),
        log_path=Path(f".cache/logs/bench-full-weights-{model.parent.name}-{runner}.log"),
        startup_timeout_s=900,
    )


async def engine_state(http: httpx.AsyncClient) -> dict:
    return (await http.get("/art/v1/engine")).json()


class Updater:
    """Publishes the exports in turn as new base versions."""

    def __init__(self, paths: list[Path]):
        self.paths, self.version, self.http_ms = paths, 0, []

    async def __call__(self, http: httpx.AsyncClient) -> None:
        self.version += 1
        path = self.paths[self.version % len(self.paths)]
        t0 = time.perf_counter()
        resp = await http.post(
            "/art/v1/weights/update", json={"path": str(path), "version": self.version}
        )
        self.http_ms.append((time.perf_counter() - t0) * 1000)
        resp.raise_for_status()


class StreamUpdater(Updater):
    """Streams the exports' tensors in turn (`--transport gloo|nixl`), from memory."""

    def __init__(self, paths: list[Path], url: str, transport: str):
        from safetensors.torch import load_file

        super().__init__(paths)
        self.tensors = [load_file(str(p / "model.safetensors")) for p in paths]
        self.url, self.sender = url, None
        self.kind = {"gloo": GlooWeightSender, "nixl": NixlWeightSender}[transport]

    def _send(self, version: int) -> None:
        if self.sender is None:
            self.sender = self.kind.connect(ArtClient(self.url, timeout=600), workers=1)
        tensors = self.tensors[version % len(self.tensors)]
        plan = [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
        self.sender.send(version, plan, lambda sink: [sink(n, t) for n, t in tensors.items()])

    async def __call__(self, http: httpx.AsyncClient) -> None:
        self.version += 1
        t0 = time.perf_counter()
        await asyncio.to_thread(self._send, self.version)
        self.http_ms.append((time.perf_counter() - t0) * 1000)


async def phase(url: str, model: str, seconds: float, clients: int, every, update) -> float:
    """Tokens/s of C clients for `seconds`, with `update` every `every` s (None: none)."""
    stop = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:

        async def updater():
            while every and time.monotonic() + every < stop:
                await asyncio.sleep(every)
                await update(http)

        t0 = time.monotonic()
        tokens, _ = await asyncio.gather(
            generate_until(http, stop, clients, PROMPT, model=model), updater()
        )
        return tokens / (time.monotonic() - t0)


async def stalls(url: str, model: str, n: int, clients: int, update: Updater):
    """n updates 0.3 s apart under load: (stalls ms, commit stalls ms, mean step ms)."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        before = len((await engine_state(http))["stalls_ms"])
        done = time.monotonic() + 3600

        async def updater():
            nonlocal done
            await asyncio.sleep(1.0)
            for _ in range(n):
                await update(http)
                await asyncio.sleep(0.3)
            done = time.monotonic()

        async def load():
            while time.monotonic() < done:
                await generate_until(http, time.monotonic() + 0.5, clients, PROMPT, model=model)

        await asyncio.gather(updater(), load())
        state = await engine_state(http)
    return state["stalls_ms"][before:], state["commit_stalls_ms"][before:], state["mean_step_ms"]


def memcpy_gbs(export: Path) -> float:
    """GB/s of copying one export's tensors into buffers allocated beforehand, best of 5: the
    ceiling a transport on this host is compared with."""
    from safetensors.torch import load_file

    tensors = list(load_file(str(export / "model.safetensors")).values())
    targets = [t.clone() for t in tensors]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for dst, src in zip(targets, tensors, strict=True):
            dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def run_model(name: str, model: Path, args) -> dict:
    paths = exports(model, name, 3)
    size = (model / "model.safetensors").stat().st_size
    t0 = time.monotonic()
    server = serve_process.start(config(model, args.runner, args.transport))
    restart_s = time.monotonic() - t0
    try:
        served = str(model.resolve())
        update = (
            StreamUpdater(paths, server.url, args.transport)
            if args.transport in BACKENDS
            else Updater(paths)
        )
        stall, commit, step = asyncio.run(
            stalls(server.url, served, args.updates, args.clients, update)
        )
        e2e = list(update.http_ms)
        ratios = []
        for _ in range(args.rounds):
            idle = asyncio.run(phase(server.url, served, args.seconds, args.clients, None, update))
            busy = asyncio.run(
                phase(server.url, served, args.seconds, args.clients, args.every, update)
            )
            ratios.append(busy / idle)
    finally:
        server.stop()
    return {
        "model": name,
        "bytes": size,
        "stall_p50": statistics.median(stall),
        "stall_p99": pct(stall, 0.99),
        "commit_p50": statistics.median(commit),
        "step_ms": step,
        "e2e_p50": statistics.median(e2e),
        "restart_s": restart_s,
        "throughput": statistics.median(ratios),
        "memcpy_gbs": memcpy_gbs(paths[0]),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runner", default="v1", choices=("v1", "v2"))
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--updates", type=int, default=12)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--every", type=float, default=1.0)
    parser.add_argument("--transport", default="files", choices=("files", *BACKENDS))
    args = parser.parse_args()
    rows = [run_model("tiny", TINY, args), run_model("large", large_model(), args)]
    print(
        f"transport {args.transport}\n"
        "| model | bytes | stall p50 / p99 ms (commit p50) | mean step ms | update e2e p50 ms | "
        "restart s (baseline) | restart / update | throughput with updates / none | "
        "update GB/s e2e (memcpy GB/s) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['model']} | {r['bytes']} | {r['stall_p50']:.2f} / {r['stall_p99']:.2f} "
            f"({r['commit_p50']:.2f}) | {r['step_ms']:.2f} | {r['e2e_p50']:.1f} | "
            f"{r['restart_s']:.1f} | {r['restart_s'] * 1000 / r['e2e_p50']:.0f}x | "
            f"{r['throughput']:.3f} | {r['bytes'] / r['e2e_p50'] / 1e6:.3f} "
            f"({r['memcpy_gbs']:.2f}) |"
        )


if __name__ == "__main__":
    main()
