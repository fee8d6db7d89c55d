"""Which vLLM model runner the serve suite's servers use: Model Runner V2 by default.

Why: on CUDA, vLLM 0.32 runs Model Runner V2 (MRV2) unless Triton is missing, so MRV2 is what
users get; the CPU build falls back to the V1 runner only because it has no Triton. Here MRV2
runs under Triton's interpreter (`TRITON_INTERPRET=1`) with a test-only `cpu` backend
registration (`tests/support/triton_cpu/`), both put on the servers' `sys.path` through
`ART_TEST_TRITON_PATHS` (`scripts/setup_triton_interpreter.sh`). `ART_TEST_MODEL_RUNNER=v1`
runs the servers on the V1 runner; `make test-serve-v1` runs the named V1 subset that way
(`SERVE_V1_SUBSET` in the Makefile): what CPU users get, and what vLLM falls
back to where MRV2 lacks a feature.

vLLM 0.34 has Model Runner V2 only, and its environment (`.venv-serve34`,
`scripts/setup_serve34_env.sh`) carries Triton with the interpreter patches itself: there the
servers need only `TRITON_INTERPRET=1`, the unpatched test copy in `.cache/triton` stays off
their path, and `ART_TEST_MODEL_RUNNER=v1` is refused (nothing to fall back to).

The variables go into this pytest process's environment (and the Triton paths onto its
`sys.path`) at start, so every server a test starts inherits them (`serve_process.start`, the
example loop's server, restarts), and an in-process EngineCore runs the same runner. Only the
serve side sets them (vLLM importable); the train suite never sees them.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUNNER_ENV = "ART_TEST_MODEL_RUNNER"
TRITON_DIR = REPO / ".cache" / "triton"
SHIM_DIR = REPO / "tests" / "support" / "triton_cpu"
RUNNERS = ("v2", "v1")


def vllm_has_v1_runner() -> bool:
    """Whether the installed vLLM still has the V1 runner (before 0.34), read from its
    metadata (no vLLM import)."""
    from packaging.version import Version

    return Version(importlib.metadata.version("vllm")).release[:2] < (0, 34)


def selected() -> str:
    """The runner this run's servers use: `v2` unless ART_TEST_MODEL_RUNNER says `v1`."""
    runner = os.environ.get(RUNNER_ENV, "v2").strip().lower() or "v2"
    if runner not in RUNNERS:
        raise pytest.UsageError(f"{RUNNER_ENV}={runner!r}: expected one of {', '.join(RUNNERS)}")
    if runner == "v1" and _serving_side() and not vllm_has_v1_runner():
        raise pytest.UsageError(
            f"{RUNNER_ENV}=v1: vLLM {importlib.metadata.version('vllm')} has Model Runner V2 "
            "only; run the V1 subset with a vLLM before 0.34 (.venv-serve)"
        )
    return runner


def server_env(runner: str) -> dict[str, str]:
    """The environment a `vllm serve` needs to run on `runner`."""
    if runner == "v1":
        return {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    if _serving_side() and not vllm_has_v1_runner():
        return {"TRITON_INTERPRET": "1"}
    return {
        "VLLM_USE_V2_MODEL_RUNNER": "1",
        "TRITON_INTERPRET": "1",
        "ART_TEST_TRITON_PATHS": os.pathsep.join((str(TRITON_DIR), str(SHIM_DIR))),
    }


def _serving_side() -> bool:
    return importlib.util.find_spec("vllm") is not None


def pytest_configure(config):
    if not _serving_side():
        return
    runner = selected()
    if runner == "v2" and vllm_has_v1_runner() and not any(TRITON_DIR.glob(".ready-*")):
        raise pytest.UsageError(
            f"Model Runner V2 needs Triton unpacked in {TRITON_DIR}: run "
            f"`bash scripts/setup_triton_interpreter.sh` (make test-serve does), or set "
            f"{RUNNER_ENV}=v1"
        )
    env = server_env(runner)
    os.environ.update(env)
    # vLLM objects built inside this process (an in-process EngineCore) see the same runner:
    # what the `.pth` hook does for a new process, done here for this one.
    for path in reversed(env.get("ART_TEST_TRITON_PATHS", "").split(os.pathsep)):
        if path and path not in sys.path:
            sys.path.insert(0, path)


def pytest_report_header(config):
    if _serving_side():
        return f"vLLM model runner of the servers: {selected()} ({RUNNER_ENV})"
    return None
