"""vLLM names the API server reaches: the engine client, serving objects, plugin loading.

`v1/engine/core_client.py` (vLLM 0.32): `AsyncMPClient.call_utility_async` reaches
`core_engine` (engine 0) only; the DP load-balancing client returns the first engine's answer
only. `core_engines` holds the ZMQ identity of each engine this client manages
(`engine_ranks_managed`, their DP ranks), and `_call_utility_async(method, *args,
engine=identity)` reaches exactly one of them.
"""

from __future__ import annotations

from art_vllm_plugin.compat import names
from art_vllm_plugin.compat.patching import load


def stat_logger_base():
    """`StatLoggerBase`: vLLM requires stat-logger plugins subclass it."""
    return load(names.STAT_LOGGER_BASE)


def plugin_groups() -> tuple[str, str]:
    """(endpoint group, stat-logger group) names."""
    return load(names.ENDPOINT_PLUGINS_GROUP), load(names.STAT_LOGGER_PLUGINS_GROUP)


async def call_engine_utility(engine_client, method: str, *args):
    """Run an EngineCore method between engine steps (`AsyncMPClient.call_utility_async`)."""
    return await engine_client.engine_core.call_utility_async(method, *args)


def engine_targets(engine_client) -> list[tuple[int, object]]:
    """(dp_rank, engine identity) of every engine this API server manages, engine 0 first."""
    core = engine_client.engine_core
    return list(zip(core.engine_ranks_managed, core.core_engines, strict=True))


async def call_engine_utility_on(engine_client, identity, method: str, *args):
    """Run an EngineCore method on one engine (by identity from `engine_targets`)."""
    return await engine_client.engine_core._call_utility_async(method, *args, engine=identity)


def api_server_count(engine_client) -> int | None:
    """How many API-server processes share these engines (`AsyncMPClient.client_count`);
    None when the client does not say (then assume several)."""
    count = getattr(getattr(engine_client, "engine_core", None), "client_count", None)
    return count if isinstance(count, int) else None


def dp_load_balancing_mode(vllm_config) -> str | None:
    """None without data parallelism; else 'internal', 'external' or 'hybrid'
    (`ParallelConfig.data_parallel_external_lb` / `data_parallel_hybrid_lb`)."""
    parallel = vllm_config.parallel_config
    if parallel.data_parallel_size <= 1:
        return None
    if parallel.data_parallel_external_lb:
        return "external"
    if parallel.data_parallel_hybrid_lb:
        return "hybrid"
    return "internal"


def max_lora_rank(engine_client) -> int:
    return engine_client.vllm_config.lora_config.max_lora_rank


def engine_dead_error_class():
    """`EngineDeadError`: the engine process is gone."""
    return load(names.ENGINE_DEAD_ERROR)


def replace_lora_path(lora_request, path: str):
    """A copy of a `LoRARequest` (a msgspec Struct) pointing at another path."""
    import msgspec

    return msgspec.structs.replace(lora_request, lora_path=path)


def serving_models_of(serving) -> object | None:
    """The `OpenAIServingModels` a serving object uses (`BaseServing.models`); every serving
    object of one app shares it."""
    return getattr(serving, "models", None)


def serving_handlers(app_state) -> tuple[object, object]:
    """(completion, chat) serving objects the stock routes use (`app.state`)."""
    return (
        getattr(app_state, "openai_serving_completion", None),
        getattr(app_state, "openai_serving_chat", None),
    )


def error_response(message: str, err_type: str, status_code: int):
    """vLLM's `ErrorResponse` (what its own handlers return; the route turns it into JSON with
    `status_code`)."""
    return load(names.CREATE_ERROR_RESPONSE)(message, err_type=err_type, status_code=status_code)


def completion_request_class():
    return load(names.COMPLETION_REQUEST)


def chat_request_class():
    return load(names.CHAT_REQUEST)


def weight_version_spans_so_far(request_state):
    """The request's weight-version spans so far (`_weight_version_spans`), or None if vLLM
    recorded no version start yet (`weight_version_starts`)."""
    if not request_state.weight_version_starts:
        return None
    return request_state._weight_version_spans()


# --- Exact leases: LoRA capacity, fresh ids (vLLM 0.32) ------------------------------------
def lora_capacity(vllm_config) -> tuple[int, int]:
    """(`max_loras`, `max_cpu_loras`) of the LoRA config (`max_cpu_loras` defaults to
    `max_loras`, `config/lora.py`)."""
    cfg = vllm_config.lora_config
    return int(cfg.max_loras), int(cfg.max_cpu_loras or cfg.max_loras)


def next_lora_int_id(serving_models) -> int:
    """A fresh LoRA id from the API server's counter (`OpenAIServingModels.lora_id_counter`,
    the one `load_lora_adapter` draws from), so it never collides with vLLM's own ids."""
    return serving_models.lora_id_counter.inc(1)
