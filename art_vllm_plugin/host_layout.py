"""Where the engines run, seen from the API server, and the one layout updates cannot serve.

An update is staged as files in a directory (`art_vllm_plugin.staging`, default `/dev/shm`)
that the API server writes and every worker of a local engine reads, leaving its markers
there. Engines on another host (vLLM's multi-node data parallelism: `--data-parallel-size-local`
below `--data-parallel-size`, the other hosts running `--headless`) cannot see that directory:
the API server sends them the adapter's bytes in the stage call instead, and they stage on
their own host (`engine_core/relayed_stages.py`). `remote_dp_ranks` says which engines those
are.

Refused at start: one engine's workers on several hosts. The engine would write a relayed
stage on its own host, which the workers on the other hosts cannot see either. Two ways there:
- `--nnodes` above the data-parallel hosts (the multiprocessing executor): refused where vLLM
  turns arguments into its config (`EngineArgs.create_engine_config`), naming the flag, in the
  API server and in a `--headless` engine process alike;
- vLLM's Ray executor placing workers on Ray nodes of other hosts: the config cannot tell
  (Ray places the workers when the executor starts), so EngineCore asks every worker for its
  host before its first step and stops there, naming the workers and hosts
  (`engine_core/worker_hosts.py`). Ray nodes on one host share its staging directory and are
  served (tests/art_vllm_plugin/engine_core/test_ray_executor.py).
(External and hybrid load balancing are left to their own refusal, `api_server/state.py`
`refuse_partial_data_parallel`, which names the mode.)
"""

from __future__ import annotations

import functools
import socket

#: The kernel's id of this boot: two machines (or one rebooted) never share it.
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def remote_dp_ranks(parallel_config) -> set[int]:
    """DP ranks of the engines on other hosts than this API server's (which runs ranks
    `data_parallel_rank` to `data_parallel_rank + data_parallel_size_local - 1`)."""
    p = parallel_config
    first = p.data_parallel_rank or 0
    local = range(first, first + p.data_parallel_size_local)
    return {rank for rank in range(p.data_parallel_size) if rank not in local}


def workers_across_hosts(parallel_config) -> str | None:
    """Why one engine's workers span several hosts in `parallel_config`, or None."""
    p = parallel_config
    dp_hosts = max(p.data_parallel_size // max(p.data_parallel_size_local, 1), 1)
    if p.nnodes > dp_hosts:
        return f"--nnodes {p.nnodes}: one engine's workers span {p.nnodes // dp_hosts} hosts"
    return None


def check_host_layout(parallel_config) -> None:
    """Raise ValueError when some worker could not see the stage its engine reads from."""
    why = workers_across_hosts(parallel_config)
    if why is None:
        return
    raise ValueError(
        f"{why}. The art plugin stages each slot update as files on the engine's host that "
        "every worker of the engine reads, so an engine's workers must share one host "
        "(engines on other hosts are fine: --data-parallel-size-local with --headless). Use "
        "data parallelism across hosts instead, or start without the plugin."
    )


def refuse_workers_across_hosts(create_engine_config):
    """Wrapper for `EngineArgs.create_engine_config` (applied by `install`)."""

    @functools.wraps(create_engine_config)
    def create_engine_config_on_one_host(self, *args, **kwargs):
        config = create_engine_config(self, *args, **kwargs)
        check_host_layout(config.parallel_config)
        return config

    return create_engine_config_on_one_host


def host_id() -> str:
    """This host, as `hostname (boot <id>)`: processes that agree on it share the staging
    directory (`/dev/shm` or `--art-staging-dir`); a container of its own has a host name of
    its own, so it counts as another host even on the same machine."""
    try:
        with open(BOOT_ID_PATH) as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown"
    return f"{socket.gethostname()} (boot {boot})"


def check_worker_hosts(engine_host: str, worker_hosts: list[str]) -> None:
    """Raise ValueError when a worker (rank = index in `worker_hosts`) runs on another host
    than its engine (`engine_host`)."""
    away = {rank: host for rank, host in enumerate(worker_hosts) if host != engine_host}
    if not away:
        return
    workers = ", ".join(f"worker {rank} on {host}" for rank, host in sorted(away.items()))
    raise ValueError(
        f"one engine's workers span hosts: {workers}, the engine on {engine_host} (vLLM's Ray "
        "executor placed them on Ray nodes of other hosts). The art plugin stages each slot "
        "update as files on the engine's host that every worker of the engine reads, so an "
        "engine's workers must share one host (engines on other hosts are fine: "
        "--data-parallel-size-local with --headless). Place each engine's workers on one node "
        "(a Ray placement group), or start without the plugin."
    )
