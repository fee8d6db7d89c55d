"""Pipeline RL on the tiny model, end to end: `make demo` (runs in `.venv-serve`).

    .venv-serve/bin/python examples/pipeline_rl/run.py [--steps 30] [--autotune]

Starts, at the same time, the trainer's `--dp` ranks (`.venv-train`, `trainer.py`: Megatron
GPT + LoRA under DDP with the distributed optimizer and communication overlap, resident
optimizer, prefix-tree packing, GRPO with TIS, PEFT export, in-flight publish, rollout worker
threads on rank 0) and a real `vllm serve --plugin art` serving the tiny model with slot
`policy`. When
the server answers `/health` the driver tells the trainer its URL (RUN_DIR/server.json), then
waits. Both run in their own process groups; on Ctrl-C, on a failure of either, or at the end,
the `finally` blocks stop the trainer's group and then the server's. Before stopping the server
it prints the slot, one completion's `policy_spans` and `/art/metrics`; at the end it plots
reward and score per step (RUN_DIR/loop.png) and prints a summary.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))

from loop_config import LoopConfig, default_trainer_host  # noqa: E402
from report import plot, summarize  # noqa: E402
from server_view import show  # noqa: E402

from art_vllm_plugin import serve_process  # noqa: E402


def say(msg: str) -> None:
    print(f"[driver] {msg}", flush=True)


def parse_args(argv=None) -> tuple[LoopConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default=".cache/pipeline_rl/run")
    parser.add_argument("--tiny", default=".cache/tiny")
    parser.add_argument("--train-python", default=str(REPO / ".venv-train" / "bin" / "python"))
    parser.add_argument("--autotune", action="store_true", help="tune workers/batch/queue online")
    parser.add_argument(
        "--push",
        action="store_true",
        help="push each version's files in the update request (the server reads no trainer "
        "directory: no --art-adapter-root for RUN_DIR)",
    )
    skip = {"run_dir", "hf_model", "init_adapter", "autotune", "push"}
    for f in fields(LoopConfig):
        if f.name in skip:
            continue
        flag = f"--{f.name.replace('_', '-')}"
        if isinstance(f.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default)
    # where the server's workers reach the trainer (--transport gloo): VLLM_HOST_IP when set,
    # else loopback (this demo's server runs beside the trainer); see default_trainer_host
    parser.set_defaults(trainer_host=default_trainer_host())
    args = parser.parse_args(argv)
    tiny = Path(args.tiny).resolve()
    values = {f.name: getattr(args, f.name) for f in fields(LoopConfig) if f.name not in skip}
    cfg = LoopConfig(
        run_dir=str(Path(args.run_dir).resolve()),
        hf_model=str(tiny / "model"),
        init_adapter=str(tiny / "adapters" / "a"),
        autotune=args.autotune,
        push=args.push,
        **values,
    )
    return cfg, args


def float32_copy(model: Path, out: Path) -> Path:
    """The tiny model with float32 weights (`--update full`): the server checks a full-weight
    update's dtypes against the checkpoint it serves, and the trainer's float32 weights must
    arrive as they are (fresh-token parity), so the served checkpoint is float32 too."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    tensors = load_file(str(model / "model.safetensors"))
    save_file(
        {k: v.to(torch.float32) if v.is_floating_point() else v for k, v in tensors.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return out


def full_server_args(cfg: LoopConfig) -> list[str]:
    """`--update full`: the base model alone (no LoRA), exports read from RUN_DIR/weights, or
    with `--transport gloo|nixl` streamed by the trainer (the server may not read RUN_DIR)."""
    if cfg.streamed:
        source = ("--weight-transfer-config", json.dumps({"backend": cfg.transfer_backend}))
    else:
        source = ("--art-adapter-root", cfg.run_dir)
    return [
        *("--dtype", cfg.server_dtype, "--max-model-len", "512"),
        *("--gpu-memory-utilization", "0.2", "--max-num-seqs", "64"),
        *serve_process.ALLOW_UNAUTHENTICATED,
        *source,
        *("--logprobs-mode", "processed_logprobs"),
    ]


def _lora_source(cfg: LoopConfig) -> tuple[str, ...]:
    """Where the server gets each adapter version: RUN_DIR (an adapter root), the request
    (`--push`: no root), or the trainer's stream (`--transport`: its engine, no root)."""
    if cfg.streamed:
        return ("--weight-transfer-config", json.dumps({"backend": cfg.transfer_backend}))
    return () if cfg.push else ("--art-adapter-root", cfg.run_dir)


def server_config(cfg: LoopConfig) -> serve_process.ServeConfig:
    """The tiny model in float32 (the trainer computes in float32: equal dtypes are what makes
    fresh-token ratios 1 up to kernel rounding), slot `policy` (and `shadow`, the wrong slot a
    test publishes to) starting from the trainer's initial adapter, adapters from RUN_DIR (with
    `--push` the trainer sends their files instead, and the server may not read RUN_DIR)."""
    args = [
        *serve_process.tiny_lora_args(max_loras=3),  # policy, shadow and a lease in one batch
        # loopback and no key: the trainer's updates and the lease need the unguarded routes
        *serve_process.ALLOW_UNAUTHENTICATED,
        "--dtype",
        cfg.server_dtype,  # overrides tiny_lora_args' bfloat16 (argparse keeps the last)
        "--lora-modules",
        f"{cfg.slot}={cfg.init_adapter}",
        "shadow=" + cfg.init_adapter,
        *_lora_source(cfg),
        "--max-num-seqs",
        "64",
        "--max-cpu-loras",
        "4",  # policy, shadow and the lease's pinned copy stay resident
        # logprobs of the distribution sampled from (after the request's temperature), which
        # the trainer reproduces by dividing its logits by the same temperature
        "--logprobs-mode",
        "processed_logprobs",
    ]
    if cfg.full:
        args = full_server_args(cfg)
    return serve_process.ServeConfig(
        model=cfg.hf_model, args=tuple(args), log_path=cfg.path / "server.log"
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_trainer_ranks(cfg: LoopConfig, python: str, config_path: Path) -> list[subprocess.Popen]:
    """`cfg.dp` trainer processes with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT), all in one new process group (rank 0's): Ctrl-C here,
    `stop_group` there, and no rank outlives the driver. (torchrun would put each worker in a
    session of its own.) LOCAL_RANK picks a rank's GPU (placement.py); `--device cpu` hides
    the GPUs from the ranks."""
    env = {
        **os.environ,
        "PYTHONPATH": f"{HERE}{os.pathsep}{REPO}",
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",  # Megatron's Apex/TE fallbacks warn on every import
        "WORLD_SIZE": str(cfg.dp),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    if cfg.device == "cpu":  # the ranks must not see a GPU: the CPU stand-ins refuse one
        env["CUDA_VISIBLE_DEVICES"] = ""
    ranks: list[subprocess.Popen] = []
    try:
        for rank in range(cfg.dp):
            # rank 0 leads a new process group (in this session: the later ranks may only join
            # a group of their own session), the others join it
            group = 0 if rank == 0 else ranks[0].pid
            ranks.append(
                subprocess.Popen(
                    [python, str(HERE / "trainer.py"), str(config_path)],
                    cwd=REPO,
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    process_group=group,
                )
            )
    except BaseException:
        if ranks:  # the started ranks would wait for the others forever
            stop_group(ranks[0])
        raise
    return ranks


def stop_group(proc: subprocess.Popen, timeout_s: float = 20) -> None:
    """SIGTERM the process group, then SIGKILL what is left."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def wait_group_gone(pgid: int, timeout_s: float = 30) -> None:
    """Return once no process of group `pgid` is left (SIGKILLed children take a moment to be
    reaped); say so if some outlive `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    say(f"process group {pgid} still has processes after {timeout_s:.0f}s")


def run(cfg: LoopConfig, args) -> dict:
    if cfg.path.exists() and any(cfg.path.iterdir()):
        if not (cfg.path / "loop_config.json").exists():
            raise SystemExit(f"--run-dir {cfg.path} is not empty and holds no earlier run: refused")
        shutil.rmtree(cfg.path)  # an earlier run of this loop: start afresh
    cfg.path.mkdir(parents=True, exist_ok=True)
    if cfg.full:
        served = float32_copy(Path(cfg.hf_model), cfg.path / "served_model")
        cfg = dataclasses.replace(cfg, hf_model=str(served))
    config_path = cfg.save()
    timings, pids = {}, {}
    t0, t0_wall = time.monotonic(), time.time()
    ranks = start_trainer_ranks(cfg, args.train_python, config_path)
    trainer = ranks[0]
    pids["trainer"] = trainer.pid  # the process group of every rank
    server = None
    try:
        scfg = server_config(cfg)
        say(f"starting vllm serve --plugin art (log {scfg.log_path}) and the trainer")
        server = serve_process.start(scfg)
        pids["server"] = server.proc.pid
        timings["server_start_s"] = time.monotonic() - t0
        say(f"server ready at {server.url} after {timings['server_start_s']:.1f}s")
        (cfg.path / "server.json").write_text(json.dumps({"url": server.url}))
        t_loop = time.monotonic()
        while any(rank.poll() is None for rank in ranks):
            if server.proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited ({server.proc.returncode}):\n{server.log_tail()}"
                )
            failed = [(i, r.returncode) for i, r in enumerate(ranks) if r.poll() not in (None, 0)]
            if failed:  # the other ranks would wait in a collective: stop them all
                raise RuntimeError(f"trainer rank {failed[0][0]} failed (exit {failed[0][1]})")
            time.sleep(0.5)
        timings["trainer_after_server_s"] = time.monotonic() - t_loop
        view = show(server.url, cfg.model_name, full=cfg.full)
        (cfg.path / "server_view.json").write_text(json.dumps(view))
    finally:
        stop_group(trainer)  # every rank: they share rank 0's process group
        for rank in ranks[1:]:  # reap them (a zombie still counts as a member of the group)
            with contextlib.suppress(subprocess.TimeoutExpired):
                rank.wait(timeout=10)
        if server is not None:
            server.stop()
        for pgid in pids.values():  # the driver returns only when none of them is left
            wait_group_gone(pgid)
        (cfg.path / "pids.json").write_text(json.dumps(pids))
    t_plot = time.monotonic()
    png = plot(cfg.path)
    timings["plot_s"] = time.monotonic() - t_plot
    timings["total_s"] = time.monotonic() - t0
    return summarize(cfg, timings, png, t0_wall)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    cfg, args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # a killed driver still stops its processes
    try:
        run(cfg, args)
    except KeyboardInterrupt:
        say("interrupted: trainer and server stopped")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
