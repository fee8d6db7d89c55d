"""vLLM's CPU platform with a Ray device key (see the package docstring)."""

from __future__ import annotations

from typing import ClassVar

from vllm.platforms.cpu import CpuPlatform


class RayCpuPlatform(CpuPlatform):
    ray_device_key = "GPU"
    ray_noset_device_env_vars: ClassVar[list[str]] = ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]
