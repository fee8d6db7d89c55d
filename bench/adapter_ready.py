"""Adapter readiness: end of a training step -> first token generated with the new version.

Runs under `.venv-train` (the trainer) against a real `vllm serve --plugin art` (started from
`.venv-serve`), on the tiny model:

- trainer: Megatron GPT with the tiny model's shape and weights, LoRA (r=8) on every HF module,
  Adam; each step is one forward/backward/`optimizer.step()` on seeded tokens;
- server: slot `policy`; a rollout thread keeps one streaming greedy generation on `policy`
  running and timestamps every chunk with the versions in its `policy_spans`.

Per step, after `optimizer.step()` returns (t0), two orders of the step's tail are timed:

- `sequential`: `export_ready` -> save the optimizer -> publish (POST, wait for the receipt);
- `overlap`: `export_ready` -> publish on a background thread (`BackgroundPublisher`) ->
  save the optimizer (while the server reads, validates, stages and swaps the adapter).

Reported: time from t0 to the first streamed token whose span carries the new version, and to
the end of the tail (both done), median over the steps; modes alternate step by step. The
optimizer save is `torch.save` of the optimizer state (+ `--extra-state-mb` of filler standing
in for a larger model's Adam moments; 0 = the tiny model's real state) to a temporary file,
fsynced, then renamed: the shape of an atomic optimizer checkpoint.

    .venv-train/bin/python bench/adapter_ready.py --steps 6 --extra-state-mb 0 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from art_megatron_ext.lora.publish_ready import (  # noqa: E402
    BackgroundPublisher,
    export_ready,
    post_update,
)
from art_vllm_plugin import serve_process  # noqa: E402

TINY = REPO / ".cache" / "tiny"


@dataclass
class Timing:
    mode: str
    extra_mb: int
    version: int
    export_s: float
    first_token_s: float
    tail_s: float


class Rollouts:
    """One streaming generation on `policy` at a time; remembers when each version first
    appeared in a chunk's spans."""

    def __init__(self, base_url: str):
        self.base_url = base_url
        self.first_seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        body = {
            "model": "policy",
            "prompt": "the trainer sends",
            "max_tokens": 400,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.Client(base_url=self.base_url, timeout=300) as client:
            while not self._stop.is_set():
                with client.stream("POST", "/v1/completions", json=body) as resp:
                    for line in resp.iter_lines():
                        if self._stop.is_set():
                            return
                        if not line.startswith("data: {"):
                            continue
                        now = time.perf_counter()
                        for choice in json.loads(line[6:]).get("choices", []):
                            for span in choice.get("policy_spans") or []:
                                self.first_seen.setdefault(span["version"], now)

    def wait_for(self, version: int, timeout_s: float = 120.0) -> float:
        deadline = time.monotonic() + timeout_s
        while version not in self.first_seen:
            if time.monotonic() > deadline:
                raise TimeoutError(f"version {version} never appeared in the rollouts' spans")
            time.sleep(0.0005)
        return self.first_seen[version]


def save_optimizer(optimizer, extra: torch.Tensor | None, path: Path) -> None:
    state = {"optimizer": optimizer.state_dict(), "filler": extra}
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


_KEEP: list = []


def build_trainer(hf_model: Path):
    from megatron.core import parallel_state

    from art_megatron_ext.lora import LoraConfig, attach_lora
    from art_megatron_ext.lora.cpu_runtime import causal_mask, cpu_megatron
    from art_megatron_ext.lora.hf_weights import load_hf_weights
    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt

    shape = GptShape.from_hf_config(hf_model)
    rdzv = tempfile.mkdtemp(prefix="art_bench_ready_")
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{rdzv}/rdzv", rank=0, world_size=1
    )
    parallel_state.initialize_model_parallel(1, 1)
    _KEEP.append(cpu_megatron())  # held for the whole run (a dropped one would exit)
    _KEEP[-1].__enter__()
    torch.manual_seed(0)
    model = build_gpt(shape)
    load_hf_weights(model, hf_model, shape)
    attach_lora(model, LoraConfig(rank=8, alpha=16.0, slot="policy"))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=1e-2)
    seq = 64
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape.vocab_size, (2, seq), generator=g)
    positions = torch.arange(seq).expand(2, seq)
    mask = causal_mask(seq)

    def train_step() -> None:
        from art_megatron_ext.lora import activate_slot, zero_lora_padding_

        with activate_slot(model, "policy"):
            loss = model(
                tokens[:, :-1], positions[:, :-1], mask[..., :-1, :-1], labels=tokens[:, 1:]
            )
        loss.mean().backward()
        zero_lora_padding_(model, optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        zero_lora_padding_(model, optimizer)

    return model, optimizer, train_step


def run(args) -> dict:
    os.environ["PATH"] = f"{REPO / '.venv-serve' / 'bin'}{os.pathsep}{os.environ['PATH']}"
    hf_model = TINY / "model"
    work = Path(tempfile.mkdtemp(prefix="art_bench_ready_"))
    root = work / "adapters"
    root.mkdir()
    config = serve_process.ServeConfig(
        model=str(hf_model),
        args=(
            *serve_process.tiny_lora_args(),
            *serve_process.ALLOW_UNAUTHENTICATED,  # loopback, no key: updates allowed
            "--lora-modules",
            f"policy={TINY / 'adapters' / 'a'}",
            "--art-adapter-root",
            str(root),
        ),
        log_path=work / "server.log",
        startup_timeout_s=900.0,  # a loaded 2-core host can take minutes
    )
    model, optimizer, train_step = build_trainer(hf_model)
    timings: list[Timing] = []
    version = 0
    with serve_process.serving(config) as server:
        rollouts = Rollouts(server.url)
        rollouts.start()
        rollouts.wait_for(0)
        publish = post_update(server.url)
        with BackgroundPublisher(publish) as publisher:
            for extra_mb in args.extra_state_mb:
                extra = torch.ones(extra_mb * 2**18) if extra_mb else None  # float32: 4 B
                for i in range(2 * args.steps + 1):
                    mode = "overlap" if i % 2 else "sequential"
                    version += 1
                    train_step()
                    t0 = time.perf_counter()
                    ready = export_ready(
                        model,
                        "policy",
                        root,
                        version=version,
                        step=version,
                        base_model_name_or_path=str(hf_model),
                    )
                    t_export = time.perf_counter()
                    ckpt = work / "optimizer.pt"
                    if mode == "sequential":
                        save_optimizer(optimizer, extra, ckpt)
                        publish(ready)
                    else:
                        pending = publisher.submit(ready)
                        save_optimizer(optimizer, extra, ckpt)
                        pending.result()
                    t_tail = time.perf_counter()
                    t_first = rollouts.wait_for(version)
                    if i == 0:
                        continue  # warm-up
                    timings.append(
                        Timing(mode, extra_mb, version, t_export - t0, t_first - t0, t_tail - t0)
                    )
        rollouts.stop()
    return summarize(timings)


def summarize(timings: list[Timing]) -> dict:
    out: dict = {"rows": []}
    for extra_mb in sorted({t.extra_mb for t in timings}):
        row = {"extra_state_mb": extra_mb}
        for mode in ("sequential", "overlap"):
            ts = [t for t in timings if t.extra_mb == extra_mb and t.mode == mode]
            row[mode] = {
                "n": len(ts),
                "export_ms": statistics.median(t.export_s for t in ts) * 1e3,
                "first_token_ms": statistics.median(t.first_token_s for t in ts) * 1e3,
                "tail_ms": statistics.median(t.tail_s for t in ts) * 1e3,
            }
        row["first_token_ratio"] = (
            row["overlap"]["first_token_ms"] / row["sequential"]["first_token_ms"]
        )
        row["tail_ratio"] = row["overlap"]["tail_ms"] / row["sequential"]["tail_ms"]
        out["rows"].append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per mode (after warm-up)")
    parser.add_argument("--extra-state-mb", type=int, nargs="+", default=[0, 256])
    parser.add_argument("--out", type=Path, default=None, help="write the JSON summary here")
    args = parser.parse_args(argv)
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
