"""Untested vLLM executors are refused at start, naming the flag (art_vllm_plugin.executor_guard).

Why refuse: with Ray, a slot update's swap can run during a forward, and tokens would carry a
label that names other weights than the ones that computed them."""

from __future__ import annotations

import pytest

from art_vllm_plugin import serve_process
from art_vllm_plugin.executor_guard import check_executor

pytestmark = pytest.mark.serve


@pytest.mark.parametrize("backend", [None, "mp", "uni"])
def test_tested_executors_pass(backend):
    check_executor(backend)


class _OwnExecutor:
    pass


@pytest.mark.parametrize(
    ("backend", "named", "why"),
    [
        ("ray", "ray", "compute on two policy versions"),
        ("external_launcher", "external_launcher", "untested"),
        ("my_pkg.executors.MyExecutor", "my_pkg.executors.MyExecutor", "untested"),
        (_OwnExecutor, f"{__name__}._OwnExecutor", "untested"),
    ],
)
def test_other_executors_are_refused_naming_the_flag(backend, named, why):
    with pytest.raises(ValueError) as refused:
        check_executor(backend)
    message = str(refused.value)
    assert message.startswith(f"--distributed-executor-backend {named}: ")
    assert why in message
    assert "Use --distributed-executor-backend mp" in message


def test_serve_with_ray_is_refused_before_anything_starts(tiny_model, server_log):
    """Ray is not installed here: without the guard vLLM would fail on that instead, with a
    message about Ray's absence rather than about labels."""
    config = serve_process.ServeConfig(
        model=str(tiny_model),
        args=("--max-model-len", "256", "--distributed-executor-backend", "ray"),
        log_path=server_log,
        startup_timeout_s=180,
    )
    with pytest.raises(serve_process.ServerStartError) as refused:
        serve_process.start(config)
    log = str(refused.value) + server_log.read_text(errors="replace")
    assert "--distributed-executor-backend ray: the art plugin labels every token" in log
    assert "Engine core initialization" not in log  # refused before any engine started
