"""Where the engines run (art_vllm_plugin.host_layout): engines on other hosts get their stage's
bytes in the stage call (test_two_hosts.py serves that for real); one engine's workers spread
over several hosts are refused at start, naming the flag, since they could not see the stage
their engine writes."""

from __future__ import annotations

import pytest

from art_vllm_plugin import serve_process
from art_vllm_plugin.host_layout import check_host_layout, remote_dp_ranks, workers_across_hosts

pytestmark = pytest.mark.serve


def _parallel(**fields):
    from vllm.config import ParallelConfig

    return ParallelConfig(**fields)


@pytest.mark.parametrize(
    ("fields", "remote"),
    [
        ({}, set()),
        ({"data_parallel_size": 2, "data_parallel_size_local": 2}, set()),  # the dp2 server
        ({"data_parallel_size": 2, "data_parallel_size_local": 1}, {1}),  # rank 1 --headless
        ({"data_parallel_size": 4, "data_parallel_size_local": 2}, {2, 3}),
        ({"data_parallel_size": 2, "data_parallel_size_local": 0}, {0, 1}),  # API-only host
    ],
)
def test_engines_on_other_hosts_are_the_ranks_beyond_the_local_ones(fields, remote):
    parallel = _parallel(**fields)
    assert remote_dp_ranks(parallel) == remote
    check_host_layout(parallel)  # served: remote engines stage from relayed bytes


def test_workers_of_one_engine_across_hosts_are_refused_naming_the_flag():
    parallel = _parallel(tensor_parallel_size=2, nnodes=2)
    named = "--nnodes 2: one engine's workers span 2 hosts"
    assert workers_across_hosts(parallel) == named
    with pytest.raises(ValueError) as refused:
        check_host_layout(parallel)
    assert str(refused.value).startswith(named)
    assert "--headless" in str(refused.value)


def test_serve_with_workers_across_hosts_is_refused_before_anything_starts(tiny_model, server_log):
    config = serve_process.ServeConfig(
        model=str(tiny_model),
        args=(
            *("--max-model-len", "256", "--tensor-parallel-size", "2"),
            *("--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1"),
        ),
        log_path=server_log,
        startup_timeout_s=180,
    )
    with pytest.raises(serve_process.ServerStartError) as refused:
        serve_process.start(config)
    log = str(refused.value) + server_log.read_text(errors="replace")
    assert "--nnodes 2: one engine's workers span 2 hosts" in log
    assert "Engine core initialization" not in log
