"""Layouts where staged files cannot reach every worker are refused at start, naming the flags
(art_vllm_plugin.host_layout). Until updates move their bytes over vLLM's own channels, a
remote engine would make every update wait five minutes for markers and fail with 500."""

from __future__ import annotations

import pytest

from art_vllm_plugin import serve_process
from art_vllm_plugin.host_layout import check_host_layout, remote_workers

pytestmark = pytest.mark.serve


def _parallel(**fields):
    from vllm.config import ParallelConfig

    return ParallelConfig(**fields)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"data_parallel_size": 2, "data_parallel_size_local": 2},  # both on this host (dp2 server)
        {"tensor_parallel_size": 2},
        # refused elsewhere, naming the mode (test_dp_modes.py)
        {"data_parallel_size": 4, "data_parallel_size_local": 2, "data_parallel_hybrid_lb": True},
        {"data_parallel_size": 2, "data_parallel_size_local": 1, "data_parallel_external_lb": True},
    ],
)
def test_one_host_layouts_pass(fields):
    check_host_layout(_parallel(**fields))


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (
            {"data_parallel_size": 2, "data_parallel_size_local": 1},
            "--data-parallel-size 2 with --data-parallel-size-local 1: 1 data-parallel engine(s) "
            "run on other hosts",
        ),
        (
            {"tensor_parallel_size": 2, "nnodes": 2},
            "--nnodes 2: one engine's workers span 2 hosts",
        ),
    ],
)
def test_multi_host_layouts_are_refused_naming_the_flags(fields, named):
    parallel = _parallel(**fields)
    assert remote_workers(parallel) == named
    with pytest.raises(ValueError) as refused:
        check_host_layout(parallel)
    assert str(refused.value).startswith(named)
    assert "art_protocol.client.Fleet" in str(refused.value)


def test_serve_with_a_remote_engine_is_refused_before_anything_starts(tiny_model, server_log):
    """The API server of a two-host data-parallel deployment (the second host would run
    `--headless`): refused where vLLM builds its config, before any engine starts."""
    config = serve_process.ServeConfig(
        model=str(tiny_model),
        args=(
            *("--max-model-len", "256"),
            *("--data-parallel-size", "2", "--data-parallel-size-local", "1"),
            *("--data-parallel-address", "127.0.0.1"),
        ),
        log_path=server_log,
        startup_timeout_s=180,
    )
    with pytest.raises(serve_process.ServerStartError) as refused:
        serve_process.start(config)
    log = str(refused.value) + server_log.read_text(errors="replace")
    assert "1 data-parallel engine(s) run on other hosts" in log
    assert "Engine core initialization" not in log
