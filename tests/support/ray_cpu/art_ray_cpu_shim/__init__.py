"""Test-only vLLM platform plugin: the CPU platform, with a Ray device key.

Why: vLLM 0.32's CPU platform declares no Ray device key (`Platform.ray_device_key` is empty),
so its Ray executor refuses to start ("current platform cpu does not support ray"). The
executor asks Ray for one device per worker (`{key: 1}` placement-group bundles, the actor's
`get_accelerator_ids()[key]`); only Ray's accelerator names pass both, so the key is "GPU" and
the test's Ray cluster declares one "GPU" per worker (`RAY_OVERRIDE_RESOURCES`, or `ray start
--num-gpus`): on CPU it is only a counter of worker places, and Ray is told not to set
`CUDA_VISIBLE_DEVICES` (a CPU torch ignores it anyway).

A platform plugin, not a patch, because the platform must be the same in EngineCore and in
every Ray actor, and Ray starts its actors as fresh interpreters: vLLM resolves the platform
in each process from the `vllm.platform_plugins` entry points, so this directory on the
servers' `PYTHONPATH` and `art_ray_cpu` in `VLLM_PLUGINS` reach every process
(`tests/support/ray_cluster.py`). Never installed into an environment, never shipped.
"""

from __future__ import annotations


def platform() -> str | None:
    """The qualified name of the Ray-capable CPU platform where vLLM would pick its CPU one."""
    from vllm.platforms import cpu_platform_plugin

    if cpu_platform_plugin() is None:
        return None
    return "art_ray_cpu_shim.platform.RayCpuPlatform"
