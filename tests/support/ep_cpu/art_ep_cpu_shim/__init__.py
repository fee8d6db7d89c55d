"""Test-only vLLM plugin: the variable-size collectives vLLM's CPU communicator lacks.

Why: with a mixture-of-experts model over several data-parallel engines, vLLM moves tokens to
the experts with its all-gather / reduce-scatter all2all manager (`AgRsAll2AllManager`, the
one the CPU communicator picks), which calls `all_gatherv` and `reduce_scatterv` on the
expert-parallel group. vLLM 0.32 and 0.34 implement them for CUDA only: on CPU the first
forward of such a server raises `NotImplementedError` (`base_device_communicator.py`), so the
layout cannot run here at all. This plugin gives `CpuCommunicator` the two (and the
`_into_output` form) on its own `torch.distributed` group, with the semantics of the CUDA
communicator's (dim 0 for the gather; per-rank `sizes`, or equal shares). It exists so the
serve suite can run the layout the plugin must commit exactly (issue 36, item 5:
`art_vllm_plugin/api_server/expert_cut.py`); it adds no behaviour vLLM has on a GPU.

A `vllm.general_plugins` entry point, because the communicators live in the worker processes:
vLLM loads general plugins in every process, so this directory on the server's `PYTHONPATH`
and `art_ep_cpu` in `VLLM_PLUGINS` reach every worker (`tests/support/server_kinds.py`,
kind `moe_dp2`). Never installed into an environment, never shipped.
"""

from __future__ import annotations


def register() -> None:
    """Give vLLM's CPU communicator the variable-size collectives (once per process)."""
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    from art_ep_cpu_shim import collectives

    if getattr(CpuCommunicator, "_art_ep_cpu", False):
        return
    CpuCommunicator.all_gatherv = collectives.all_gatherv
    CpuCommunicator.reduce_scatterv = collectives.reduce_scatterv
    CpuCommunicator.reduce_scatterv_into_output = collectives.reduce_scatterv_into_output
    CpuCommunicator._art_ep_cpu = True
