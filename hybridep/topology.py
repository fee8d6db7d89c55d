"""Where the ranks of an EP group run: what `auto` backend selection reads before it picks CUDA.

Why: the CUDA backend needs every rank of the group on one host (peers' buffers are mapped
through CUDA IPC) and an sm_90 GPU on each (its kernels are built for sm_90a only). It used to
find a multi-host group out inside its constructor, which Megatron calls from
`init_hybrid_ep_buffer`, so "auto" crashed there instead of choosing the torch backend. The
facts are gathered once from every rank (`gather_topology`, collective) so every rank reaches
the same verdict from the same facts: no rank builds a CUDA buffer its peers do not. Tests
pass a `GroupTopology` of their own (two hosts, an sm_80 GPU) instead of patching the world.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from hybridep import build as kbuild


@dataclass(frozen=True)
class GroupTopology:
    """Per rank of the group: its host name and the arch its current GPU compiles for
    (`kbuild.device_arch()`: "sm_90a" on Hopper; None where no CUDA device is visible)."""

    hostnames: tuple[str, ...]
    archs: tuple[str | None, ...]


def local_facts() -> tuple[str, str | None]:
    """This process's host name and GPU arch (None without a GPU)."""
    return socket.gethostname(), kbuild.device_arch()


def gather_topology(group: Any) -> GroupTopology:
    """Every rank's `local_facts` (collective over `group`; this process alone when no
    process group is initialized)."""
    mine = local_facts()
    if not (dist.is_available() and dist.is_initialized()):
        facts = [mine]
    else:
        facts = [None] * dist.get_world_size(group)
        dist.all_gather_object(facts, mine, group=group)
    return GroupTopology(tuple(f[0] for f in facts), tuple(f[1] for f in facts))


def cuda_topology_reason(topology: GroupTopology) -> str | None:
    """Why the CUDA backend cannot run on a group laid out as `topology`, or None."""
    missing = [r for r, arch in enumerate(topology.archs) if arch is None]
    if missing:
        return f"no CUDA device is visible on rank(s) {missing} of the group"
    hosts = sorted(set(topology.hostnames))
    if len(hosts) > 1:
        return (
            f"the group spans {len(hosts)} hosts {hosts}; the CUDA backend handles one node "
            "(CUDA IPC over NVLink), inter-node (RDMA) dispatch is not implemented"
        )
    other = {r: arch for r, arch in enumerate(topology.archs) if arch != kbuild.SM90A}
    if other:
        named = ", ".join(f"rank {r}: {arch}" for r, arch in other.items())
        return f"the HybridEP kernels are built for {kbuild.SM90A} only, but the group has {named}"
    return None
