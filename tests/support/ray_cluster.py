"""A local Ray cluster of two nodes, one worker place each, for the serve suite's Ray server.

Why two nodes: vLLM picks its Ray executor for engines whose workers span hosts, and the
plugin must be exact there (issue 36, item 6). Two Ray nodes on this one host, each declaring
one worker place, make the executor put the engine's two tensor-parallel workers on two
nodes: one beside EngineCore (shared-memory queues) and one on the other node (TCP queues),
as on two hosts. What two nodes on one host cannot show is a second filesystem: both see
the staging directory, which the plugin checks at start (`art_vllm_plugin.host_layout`).

The nodes run on Ray's own local-cluster helper (`ray.cluster_utils.Cluster`, the one Ray's
tests use): each node's processes are children of this one, stopped by `stop()`, so nothing
outlives the server and no `ray stop` touches another Ray on the machine. Each node declares
one "GPU": the test platform's Ray device key on CPU (`tests/support/ray_cpu/`), a counter of
worker places. The raylets get the servers' environment (`env`): Ray starts its worker actors
from the raylet, before vLLM hands them EngineCore's variables, and the actor must already
resolve the Ray-capable test platform. Token authentication is off: the cluster listens on
this host only and lives for one server.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

#: Where the Ray test platform lives (a `vllm.platform_plugins` entry point), and its name.
SHIM_DIR = Path(__file__).resolve().parent / "ray_cpu"
PLATFORM_PLUGIN = "art_ray_cpu"
#: Ray's token authentication, off for the test cluster (see the module docstring).
NO_AUTH = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
#: Object store per node: Ray's default is 30% of memory; the engine passes little through it.
OBJECT_STORE_BYTES = 100 * 1024 * 1024


def server_env(base: Mapping[str, str]) -> dict[str, str]:
    """`base` plus what a vLLM process needs to run the Ray executor on CPU here: the test
    platform on `PYTHONPATH` and in `VLLM_PLUGINS` (beside `art`), no Ray token."""
    inherited = base.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    path = os.pathsep.join(p for p in (str(SHIM_DIR), inherited) if p)
    plugins = [p for p in base.get("VLLM_PLUGINS", "art").split(",") if p]
    return {
        **base,
        **NO_AUTH,
        "PYTHONPATH": path,
        "VLLM_PLUGINS": ",".join([*plugins, PLATFORM_PLUGIN]),
    }


@dataclass
class LocalRay:
    """A running local cluster; `address` is what a server's `RAY_ADDRESS` names."""

    cluster: object  # ray.cluster_utils.Cluster
    address: str

    def actor_nodes(self, class_name: str) -> list[str]:
        """The Ray node ids of the live actors of `class_name` (vLLM's workers:
        "RayWorkerProc"), read from the cluster's own table."""
        table = self.cluster.global_state.actor_table(None, actor_state_name="ALIVE")
        return [a["Address"]["NodeID"] for a in table.values() if a["ActorClassName"] == class_name]

    def stop(self) -> None:
        self.cluster.shutdown()


def start(env: Mapping[str, str], nodes: int = 2) -> LocalRay:
    """Start `nodes` Ray nodes of one worker place each, their raylets in `env`."""
    os.environ.update(NO_AUTH)  # the head's GCS reads it from this process
    from ray.cluster_utils import Cluster

    node_args = {
        "num_cpus": 1,
        "num_gpus": 1,
        "object_store_memory": OBJECT_STORE_BYTES,
        "include_dashboard": False,
        "env_vars": dict(env),
    }
    cluster = Cluster(initialize_head=True, head_node_args=node_args, shutdown_at_exit=True)
    try:
        for _ in range(nodes - 1):
            cluster.add_node(**node_args)
        cluster.wait_for_nodes()
    except BaseException:
        cluster.shutdown()
        raise
    return LocalRay(cluster, cluster.address)
