"""Which platform and runner serve: decisions the plugin makes in every process."""

from __future__ import annotations

from art_vllm_plugin.compat import names
from art_vllm_plugin.compat.patching import load
from art_vllm_plugin.compat.versions import has_v1_runner


def is_cpu_platform() -> bool:
    return load(names.CURRENT_PLATFORM).is_cpu()


def set_thread_device(device) -> None:
    """Make the calling thread use `device` (`current_platform.set_device`), as vLLM's own
    worker threads do first (`MultiprocExecutor.async_output_busy_loop`): a new thread does not
    inherit the current device, and a CUDA call on it would create a context on device 0."""
    load(names.CURRENT_PLATFORM).set_device(device)


def routes_use_worker_path(vllm_config) -> bool:
    """True when the V1 runner of the CPU platform serves: the plugin's worker capture fills
    the native routed-experts output there (MRV2 has its own). 0.34 has MRV2 only."""
    if not has_v1_runner():
        return False
    return is_cpu_platform() and not vllm_config.use_v2_model_runner


def model_runner_name(vllm_config) -> str:
    """Which model runner serves: "v2" (Model Runner V2, the only one from 0.34) or "v1"."""
    if not has_v1_runner():
        return "v2"
    return "v2" if vllm_config.use_v2_model_runner else "v1"


def current_vllm_config_or_none():
    """The config of the model being built (`get_current_vllm_config_or_none`)."""
    return load(names.CURRENT_VLLM_CONFIG)()


def num_experts(vllm_config) -> int:
    return vllm_config.model_config.get_num_experts()


def lora_request(**kwargs):
    """A `vllm.lora.request.LoRARequest`."""
    return load(names.LORA_REQUEST)(**kwargs)
