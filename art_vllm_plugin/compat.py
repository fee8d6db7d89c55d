"""The vLLM version gate and every private vLLM name the plugin touches.

Why: the plugin patches vLLM internals (argument parser construction today; engine-core and
worker internals as features arrive). Those names move between minor releases, so they are all
reached through this module: a vLLM bump is one file to audit, and an untested vLLM fails at
plugin load with a message naming the supported range instead of misbehaving mid-request.
"""

from __future__ import annotations

SUPPORTED_VLLM = ("0.32.0", "0.33")  # [min, max)
SUPPORTED_RANGE_TEXT = "vllm >=0.32.0,<0.33"


class UnsupportedVllmVersion(RuntimeError):
    """Raised when the plugin is selected on a vLLM outside the tested range."""


def _release(version: str) -> tuple[int, ...]:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release
    except InvalidVersion as exc:
        raise UnsupportedVllmVersion(
            f"cannot parse vLLM version {version!r}; the art plugin supports {SUPPORTED_RANGE_TEXT}"
        ) from exc


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM outside [SUPPORTED_VLLM); a local suffix such as '+cpu' is ignored."""
    lo, hi = (_release(v) for v in SUPPORTED_VLLM)
    if not (lo <= _release(version) < hi):
        raise UnsupportedVllmVersion(
            f"vLLM {version} is not supported by the art plugin (art-pipeline); tested range is "
            f"{SUPPORTED_RANGE_TEXT}. Install a supported vLLM, or unselect the plugin "
            "(drop `--plugin art` / remove 'art' from VLLM_PLUGINS)."
        )


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def require_supported_vllm() -> str:
    """Check the installed vLLM; returns its version string."""
    version = vllm_version()
    check_vllm_version(version)
    return version


# --- CLI: `vllm serve` parser construction ------------------------------------------------
def engine_args_class():
    """`vllm.engine.arg_utils.EngineArgs`, whose `add_cli_args` builds the serve options."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs


# --- Stat logger plugin base class --------------------------------------------------------
def stat_logger_base():
    """`vllm.v1.metrics.loggers.StatLoggerBase`: vLLM requires stat-logger plugins subclass it."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    return StatLoggerBase


# --- In-flight LoRA updates: EngineCore, worker, LoRA manager --------------------------------
def engine_core_class():
    """`vllm.v1.engine.core.EngineCore`: utility calls are its methods, run between steps."""
    from vllm.v1.engine.core import EngineCore

    return EngineCore


def worker_base_class():
    """`vllm.v1.worker.worker_base.WorkerBase`: `collective_rpc` calls its methods by name."""
    from vllm.v1.worker.worker_base import WorkerBase

    return WorkerBase


def worker_lora_manager(worker):
    """The worker's `LRUCacheWorkerLoRAManager` (`model_runner.lora_manager`)."""
    runner = getattr(worker, "model_runner", None)
    manager = getattr(runner, "lora_manager", None)
    if manager is None:
        raise RuntimeError("LoRA is not enabled on this worker; start vLLM with --enable-lora")
    return manager


def lora_request(**kwargs):
    from vllm.lora.request import LoRARequest

    return LoRARequest(**kwargs)


# --- Response assembly: OpenAI-compatible serving classes -----------------------------------
def serving_completion_class():
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    return OpenAIServingCompletion


def serving_chat_class():
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    return OpenAIServingChat


def replace_lora_path(lora_request, path: str):
    """A copy of a `LoRARequest` (a msgspec Struct) pointing at another path."""
    import msgspec

    return msgspec.structs.replace(lora_request, lora_path=path)


async def call_engine_utility(engine_client, method: str, *args):
    """Run an EngineCore method between engine steps (`AsyncMPClient.call_utility_async`)."""
    return await engine_client.engine_core.call_utility_async(method, *args)


def max_lora_rank(engine_client) -> int:
    return engine_client.vllm_config.lora_config.max_lora_rank


# --- Prefix-cache salting: Request block hashes and the scheduler's waiting queues ----------
def rehash_request_blocks(request) -> None:
    """Recompute a `vllm.v1.request.Request`'s prompt block hashes after its salt changed."""
    request.block_hashes = []
    request.update_block_hashes()


def waiting_requests(scheduler):
    """Requests in the scheduler's waiting queues (not yet scheduled)."""
    for name in ("waiting", "skipped_waiting"):
        queue = getattr(scheduler, name, None)
        if queue is not None:
            yield from list(queue)


def request_state_class():
    """`vllm.v1.engine.output_processor.RequestState`: builds each `CompletionOutput`."""
    from vllm.v1.engine.output_processor import RequestState

    return RequestState
