"""`auto` backend selection reads where the group's ranks run (`hybridep.topology`).

A multi-node EP group or a GPU other than sm_90 must get the torch backend with the reason
logged, never a failure inside the CUDA backend's constructor (which Megatron calls from
`init_hybrid_ep_buffer`). Topologies that do not exist here (two hosts, an sm_80 GPU) are
passed in; the gathering itself runs over a real gloo group.
"""

from __future__ import annotations

import logging
import socket

import pytest
from support.train_ranks import run_ranks

from hybridep import BackendUnavailable, select_backend
from hybridep.backends import cuda_unavailable_reason
from hybridep.backends.torch_ref import TorchBackend
from hybridep.topology import GroupTopology, cuda_topology_reason, gather_topology

ONE_HOPPER_NODE = GroupTopology(("node0", "node0"), ("sm_90a", "sm_90a"))
TWO_NODES = GroupTopology(("node0", "node1"), ("sm_90a", "sm_90a"))
AN_AMPERE_RANK = GroupTopology(("node0", "node0"), ("sm_90a", "sm_80"))
A_RANK_WITHOUT_GPU = GroupTopology(("node0", "node0"), ("sm_90a", None))


def test_the_topology_names_what_the_cuda_backend_lacks():
    assert cuda_topology_reason(ONE_HOPPER_NODE) is None
    assert "spans 2 hosts ['node0', 'node1']" in cuda_topology_reason(TWO_NODES)
    assert "sm_90a only, but the group has rank 1: sm_80" in cuda_topology_reason(AN_AMPERE_RANK)
    assert "no CUDA device is visible on rank(s) [1]" in cuda_topology_reason(A_RANK_WITHOUT_GPU)


@pytest.mark.parametrize(
    "topology, reason",
    [(TWO_NODES, "spans 2 hosts"), (AN_AMPERE_RANK, "rank 1: sm_80")],
)
def test_auto_takes_the_torch_backend_and_logs_why(caplog, topology, reason):
    with caplog.at_level(logging.INFO, logger="hybridep.backends"):
        assert select_backend("auto", None, topology=topology) is TorchBackend
    assert any(reason in r.getMessage() and "'auto'" in r.getMessage() for r in caplog.records)
    assert reason in cuda_unavailable_reason(None, topology)
    with pytest.raises(BackendUnavailable, match=reason):  # asked for by name: refused
        select_backend("cuda", None, topology=topology)


def _gather(rank: int, world: int) -> GroupTopology:
    import torch.distributed as dist

    return gather_topology(dist.group.WORLD)


def test_every_rank_gathers_the_same_facts_over_a_gloo_group():
    """Every rank gets every rank's host and GPU (none here), so every rank decides alike."""
    got = run_ranks(_gather, world_size=2)
    assert got[0] == got[1] == GroupTopology((socket.gethostname(),) * 2, (None, None))
    assert "no CUDA device is visible on rank(s) [0, 1]" in cuda_topology_reason(got[0])
