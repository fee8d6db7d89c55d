"""Test-side helpers for real `vllm serve` processes on the tiny model.

A server start costs 30-60 s here, so modules share one server per configuration
(`server_pool.py`, `server_kinds.py`) and start one of their own only where the test needs it
(a restart, a refused start, a configuration that is the subject of the test).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from art_vllm_plugin import serve_process
from art_vllm_plugin.serve_process import tiny_lora_args

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / ".cache" / "tiny"

#: Serve flags for LoRA on the tiny model (docs/vllm-on-cpu.md "Serving").
LORA_ARGS = tiny_lora_args()


def tiny_paths() -> tuple[Path, Path]:
    """(model dir, adapters dir) of the tiny model, generating it if `make tiny` has not run."""
    if not (TINY / "model" / "config.json").exists():
        from art_vllm_plugin.tiny_model import generate

        generate(TINY)
    return TINY / "model", TINY / "adapters"


def restart_same_port(server: serve_process.ServerProcess) -> serve_process.ServerProcess:
    """Stop `server` (if it still runs) and start its config again on the same port.

    A replica that restarted behind a load balancer keeps its address: that is what a fleet
    must bring back up to date. The new server logs to `<log>.restart.log` beside the old log.
    """
    server.stop()
    config = server.config
    log_path = server.log_path.with_name(server.log_path.stem + ".restart.log")
    env = {k: v for k, v in os.environ.items() if k not in config.unset_env}
    env.update(serve_process.VLLM_RUN_ENV)
    env.update(config.env)
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            serve_process.build_command(config, server.port),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    again = serve_process.ServerProcess(config, server.port, proc, log_path)
    try:
        again.wait_healthy()
    except BaseException:
        again.stop()
        raise
    return again
