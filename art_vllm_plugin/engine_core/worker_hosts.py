"""Before the first step, every worker of this engine must run on the engine's host.

Why: updates are staged as files on the engine's host (`art_vllm_plugin.staging`), which every
worker reads and where each leaves its marker. vLLM's Ray executor may place an engine's
workers on Ray nodes of other hosts, which the config does not show (`host_layout`); a worker
there could neither read a stage nor answer it, and every update would fail. So EngineCore asks
each worker for its host once, when its busy loop starts (one RPC, before any request), and
stops the engine with the workers and hosts named (`host_layout.check_worker_hosts`).
"""

from __future__ import annotations

from art_vllm_plugin import compat, host_layout


def check_hosts(core) -> None:
    """Raise ValueError when a worker of `core` runs on another host."""
    hosts = compat.engine_executor(core).collective_rpc("art_host_id")
    host_layout.check_worker_hosts(host_layout.host_id(), list(hosts))


def hosts_before_busy_loop(run_busy_loop):
    """Wrapper for `run_busy_loop`: the check above, before the first step."""

    def run_busy_loop_on_one_host(self):
        check_hosts(self)
        return run_busy_loop(self)

    return run_busy_loop_on_one_host
