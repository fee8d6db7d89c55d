"""Executors whose ordering keeps labels exact are accepted; the others are refused at start,
naming the flag (art_vllm_plugin.executor_guard).

Why refuse: on Ray's compiled-graph executor a slot update's swap would not ride the step and
could run during a forward, and tokens would carry a label that names other weights than the
ones that computed them. vLLM's default Ray executor keeps `mp`'s one ordered queue and is
accepted (issue 36, item 6; served for real in engine_core/test_ray_executor.py)."""

from __future__ import annotations

import pytest

from art_vllm_plugin import serve_process
from art_vllm_plugin.executor_guard import check_executor

pytestmark = pytest.mark.serve


@pytest.mark.parametrize("backend", [None, "mp", "uni", "ray"])
def test_executors_with_one_ordered_queue_pass(backend, monkeypatch):
    """ "ray" is vLLM's default Ray executor (RayExecutorV2, a MultiprocExecutor that keeps its
    step and RPC methods). Before issue 36 item 6 it was refused by name."""
    monkeypatch.delenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", raising=False)
    check_executor(backend)


def test_a_multiproc_subclass_that_keeps_the_queue_passes():
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    class Placed(MultiprocExecutor):
        def _init_executor(self):
            pass

    check_executor(Placed)


class _OwnExecutor:
    pass


def _reordering_executor():
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    class Reordering(MultiprocExecutor):
        def collective_rpc(self, *args, **kwargs):
            pass

    return Reordering


@pytest.mark.parametrize(
    ("backend", "named", "why"),
    [
        ("external_launcher", "external_launcher", "ordering is untested"),
        ("my_pkg.executors.MyExecutor", "my_pkg.executors.MyExecutor", "cannot resolve"),
        (_OwnExecutor, f"{__name__}._OwnExecutor", "cannot resolve"),
        (_reordering_executor, "Reordering", "ordering is untested"),
    ],
)
def test_other_executors_are_refused_naming_the_flag(backend, named, why):
    if callable(backend) and not isinstance(backend, type):
        backend = backend()
    with pytest.raises(ValueError) as refused:
        check_executor(backend)
    message = str(refused.value)
    assert message.startswith("--distributed-executor-backend ")
    assert named in message.split(":")[0]
    assert why in message
    assert "Use --distributed-executor-backend mp, uni or ray" in message


def test_rays_compiled_graph_executor_is_refused_naming_the_variable(monkeypatch):
    """vLLM 0.32 runs Ray's compiled-graph executor only when asked to: its forwards call the
    model runner directly (no ride, no label) while its RPCs run concurrently."""
    monkeypatch.setenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "0")
    with pytest.raises(ValueError) as refused:
        check_executor("ray")
    message = str(refused.value)
    assert message.startswith("--distributed-executor-backend ray: ")
    assert "VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0 picks Ray's compiled-graph executor" in message
    assert "RayDistributedExecutor" in message


def test_serve_on_rays_compiled_graph_is_refused_before_anything_starts(tiny_model, server_log):
    """Refused before any engine or Ray cluster starts, naming the variable."""
    config = serve_process.ServeConfig(
        model=str(tiny_model),
        args=("--max-model-len", "256", "--distributed-executor-backend", "ray"),
        env={"VLLM_USE_RAY_V2_EXECUTOR_BACKEND": "0"},
        log_path=server_log,
        startup_timeout_s=180,
    )
    with pytest.raises(serve_process.ServerStartError) as refused:
        serve_process.start(config)
    log = str(refused.value) + server_log.read_text(errors="replace")
    assert "--distributed-executor-backend ray: the art plugin labels every token" in log
    assert "VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0" in log
    assert "Engine core initialization" not in log  # refused before any engine started
