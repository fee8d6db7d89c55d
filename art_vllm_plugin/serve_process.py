"""Start and stop a real `vllm serve` subprocess on 127.0.0.1 (demo, tests, benchmarks).

Why a helper: every place that runs the plugin end to end needs the same things done right: a
free loopback port, the offline/no-telemetry environment from `docs/vllm-on-cpu.md`, a log
file to show when start-up fails, readiness on `/health`, and a stop that takes the EngineCore
and worker processes down too (the server runs in its own process group), also when the
caller fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: The environment every vLLM run on our machines needs (no usage stats, offline hub,
#: loopback host IP, a small CPU KV cache).
VLLM_RUN_ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


#: For servers these helpers start without an API key (demos, tests, benchmarks): they listen on
#: 127.0.0.1 only, so they open the plugin's state-changing routes (updates, leases, test
#: hooks), which a server without `--api-key` refuses by default (`api_server/auth.py`).
ALLOW_UNAUTHENTICATED = ("--art-allow-unauthenticated",)


def tiny_lora_args(max_loras: int = 2) -> tuple[str, ...]:
    """Serve flags for LoRA on the tiny model (demo, tests, benchmarks).

    `--gpu-memory-utilization` is the share of *host* memory the CPU backend insists is free
    at start-up (default 0.92): keep it small so a server starts while others run.
    """
    return (
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--max-loras",
        str(max_loras),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "512",
        "--gpu-memory-utilization",
        "0.2",
    )


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy; the message carries its log tail."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_executable() -> str:
    """The `vllm` console script of the running interpreter's environment."""
    candidate = Path(sys.executable).with_name("vllm")
    if candidate.exists():
        return str(candidate)
    found = shutil.which("vllm")
    if not found:
        raise FileNotFoundError(
            f"no `vllm` script next to {sys.executable} or on PATH; run `make serve-env`"
        )
    return found


@dataclass
class ServeConfig:
    """What to serve and how. `plugin=True` adds `--plugin art` to the command line."""

    model: str
    args: Sequence[str] = ()
    plugin: bool = True
    env: Mapping[str, str] = field(default_factory=dict)
    unset_env: Sequence[str] = ("VLLM_PLUGINS",)
    log_path: Path | None = None
    startup_timeout_s: float = 300.0


@dataclass
class ServerProcess:
    config: ServeConfig
    port: int
    proc: subprocess.Popen
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"vllm serve exited with code {self.proc.returncode} during start-up; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        raise ServerStartError(
            f"vllm serve not healthy after {self.config.startup_timeout_s:.0f}s; "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM the whole process group, then SIGKILL what is left; returns the exit code."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout_s)
        # Children (EngineCore, workers) share the group; make sure none outlives the server.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        return self.proc.returncode


def build_command(config: ServeConfig, port: int) -> list[str]:
    cmd = [vllm_executable(), "serve", config.model]
    if config.plugin:
        cmd += ["--plugin", "art"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), *config.args]
    return cmd


#: Starts tried when the port picked for a server was taken before vLLM bound it.
PORT_ATTEMPTS = 3


def start(config: ServeConfig) -> ServerProcess:
    """Start the server and wait until `/health` answers; stops it again if start-up fails.

    The port is picked free here and bound by vLLM a few seconds later; another process (a
    second server, a trainer's rendezvous) can take it in between. A start that fails with
    "Address already in use" is tried again on a new port (at most `PORT_ATTEMPTS` starts);
    any other failure is raised at once."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            return _start_once(config)
        except ServerStartError as exc:
            if "Address already in use" not in str(exc) or attempt == PORT_ATTEMPTS:
                raise
            print(f"[serve] port taken before vLLM bound it; starting again ({exc.args[0][:80]})")
    raise AssertionError("unreachable")


def _start_once(config: ServeConfig) -> ServerProcess:
    port = free_port()
    log_path = config.log_path or Path(f".cache/logs/vllm-serve-{port}.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in config.unset_env}
    env.update(VLLM_RUN_ENV)
    env.update(config.env)
    log = log_path.open("w")
    try:
        proc = subprocess.Popen(
            build_command(config, port),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # own process group: stop() reaches EngineCore and workers
        )
    finally:
        log.close()
    server = ServerProcess(config=config, port=port, proc=proc, log_path=log_path)
    try:
        server.wait_healthy()
    except BaseException:
        server.stop()
        raise
    return server


@contextlib.contextmanager
def serving(config: ServeConfig) -> Iterator[ServerProcess]:
    server = start(config)
    try:
        yield server
    finally:
        server.stop()
