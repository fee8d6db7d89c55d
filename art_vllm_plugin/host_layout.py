"""Refuse, at start, the layouts where an update's staged files cannot reach every worker.

Why: an update is staged as files in a directory (`art_vllm_plugin.staging`, default
`/dev/shm`) that the API server writes and every worker of every engine reads, leaving its
markers there. That holds where the API server and all the workers it updates run on one host.
Two of vLLM's layouts break it:

- engines on another host behind this API server: data parallelism with
  `--data-parallel-size-local` below `--data-parallel-size` (the remote engines run
  `--headless`). External and hybrid load balancing are left to their own refusal
  (`api_server/state.py`, `refuse_partial_data_parallel`), which names the mode;
- one engine's workers on several hosts (`--nnodes` above the data-parallel nodes).

There, workers could not see the stage: an update waited for their markers for five minutes
and failed with 500. A clear refusal at start, naming the flags, is better. Moving the bytes
to remote workers over vLLM's own channels is the fix this guard stands in for (issue 23
item 3, open).

The check runs where vLLM turns arguments into its config (`EngineArgs.create_engine_config`),
in the API server and in a `--headless` engine process alike.
"""

from __future__ import annotations

import functools


def remote_workers(parallel_config) -> str | None:
    """What in `parallel_config` puts workers out of the API server's reach, or None."""
    p = parallel_config
    size, local = p.data_parallel_size, p.data_parallel_size_local
    per_host_lb = p.data_parallel_external_lb or p.data_parallel_hybrid_lb
    if size > 1 and local < size and not per_host_lb:
        return (
            f"--data-parallel-size {size} with --data-parallel-size-local {local}: "
            f"{size - local} data-parallel engine(s) run on other hosts"
        )
    dp_hosts = max(size // max(local, 1), 1)
    if p.nnodes > dp_hosts:
        return f"--nnodes {p.nnodes}: one engine's workers span {p.nnodes // dp_hosts} hosts"
    return None


def check_host_layout(parallel_config) -> None:
    """Raise ValueError when workers would not see the API server's staging directory."""
    why = remote_workers(parallel_config)
    if why is None:
        return
    raise ValueError(
        f"{why}. The art plugin stages each slot update as files that the API server writes "
        "and every worker reads, so it serves only where the API server and the workers it "
        "updates share one host; multi-host layouts are not supported yet. Run one server "
        "per host behind your load balancer and publish to all of them with "
        "art_protocol.client.Fleet, or start without the plugin."
    )


def refuse_remote_workers(create_engine_config):
    """Wrapper for `EngineArgs.create_engine_config` (applied by `install`)."""

    @functools.wraps(create_engine_config)
    def create_engine_config_on_one_host(self, *args, **kwargs):
        config = create_engine_config(self, *args, **kwargs)
        check_host_layout(config.parallel_config)
        return config

    return create_engine_config_on_one_host
