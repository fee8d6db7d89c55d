"""vLLM names the API server reaches: the engine client, serving objects, plugin loading.

`v1/engine/core_client.py` (vLLM 0.32): `AsyncMPClient.call_utility_async` reaches
`core_engine` (engine 0) only; the DP load-balancing client returns the first engine's answer
only. `core_engines` holds the ZMQ identity of each engine this client manages
(`engine_ranks_managed`, their DP ranks), and `_call_utility_async(method, *args,
engine=identity)` reaches exactly one of them.
"""

from __future__ import annotations

import json
from http import HTTPStatus

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


async def engines_paused(engine_client) -> bool:
    """Whether the engines' schedulers are paused (every engine must agree:
    `is_scheduler_paused_async` raises when they differ)."""
    return bool(await engine_client.engine_core.is_scheduler_paused_async())


async def pause_engines_keeping_requests(engine_client) -> None:
    """Pause every engine's scheduler, requests kept (`mode="keep"`, caches kept), and return
    once none steps: with data parallelism the engines stop after the same step of their
    group (`DPEngineCoreProc._pause_complete`'s two-phase consensus), so none has a batch in
    flight when this returns."""
    await engine_client.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)


async def resume_engines(engine_client) -> None:
    """Resume every engine's scheduler (DP engines resume together: `resume_scheduler`)."""
    await engine_client.engine_core.resume_scheduler_async()


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


def error_response(message: str, err_type: str, status_code: int, param: str | None = None):
    """vLLM's `ErrorResponse` (what its own handlers return; the route turns it into JSON with
    `status_code`); `param` names the request field at fault."""
    return load(names.CREATE_ERROR_RESPONSE)(
        message, err_type=err_type, status_code=HTTPStatus(status_code), param=param
    )


def streaming_error_event(message: str, err_type: str, status_code: int) -> str:
    """One SSE event in vLLM's streaming error format: what its stream generators send before
    `data: [DONE]` when a stream fails (`create_streaming_error_response`: `json.dumps` of an
    `ErrorResponse`)."""
    body = error_response(message, err_type, status_code).model_dump()
    return f"data: {json.dumps(body)}\n\n"


def completion_request_class():
    return load(names.COMPLETION_REQUEST)


def chat_request_class():
    return load(names.CHAT_REQUEST)


def weight_version_span(label: str | None, start: int, end: int):
    """vLLM's `WeightVersionSpan(version, start, end)`: output tokens `[start, end)` were
    sampled by the weights labelled `label`."""
    return load(names.WEIGHT_VERSION_SPAN)(label, start, end)


def request_state_external_id(request_state) -> str:
    """The id the API server gave the request (`RequestState.external_req_id`); n>1 children
    and beam-search steps carry the id of the request they belong to inside theirs."""
    return request_state.external_req_id


def cpu_lora_logits_fail_on_batches(vllm_config) -> bool:
    """Whether computing prompt logprobs can take EngineCore down on this server.

    vLLM 0.32 on the CPU platform (`get_punica_wrapper` -> `PunicaWrapperCPU`), both the V1
    runner and Model Runner V2: with `--enable-lora`, every logits computation goes through
    `LogitsProcessorWithLoRA` -> `PunicaWrapperCPU.add_lora_logits` -> `bgmv_shrink`, which
    pairs one LoRA index per *request* with each logits row. Sampling has one row per request;
    prompt logprobs have one row per prompt token, so with two or more requests in the batch
    the `einsum` sizes differ and the worker raises (`subscript b has size 2 ... does not
    broadcast with previously seen size 7`), which ends EngineCore and every request on it.
    With one request per batch (`--max-num-seqs 1`) the single index broadcasts and the
    result is right. GPUs use `PunicaWrapperGPU`, which maps prompt rows itself."""
    if vllm_config.lora_config is None or vllm_config.scheduler_config.max_num_seqs <= 1:
        return False
    cpu = names.CPU_PUNICA_WRAPPER
    wrapper = load(names.CURRENT_PLATFORM).get_punica_wrapper()
    return wrapper == f"{cpu.module}.{cpu.qualname}"


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


#: The modules vLLM 0.32 registers its control routes from: the dev-mode routers
#: (`VLLM_SERVER_DEV_MODE=1`: sleep, cache resets, `collective_rpc`, server info), the RL
#: routers (pause/resume, the weight-transfer family) and elastic EP scaling. vLLM's own API
#: key check (`AuthenticationMiddleware`) covers only `/v1/*`, so none of these ask for it.
CONTROL_ROUTE_MODULES = (
    "vllm.entrypoints.serve.dev.",
    "vllm.entrypoints.rl.",
    "vllm.entrypoints.serve.elastic_ep.",
)


def control_routes(app) -> frozenset[str]:
    """Paths of the app's routes, registered by vLLM's control routers
    (`CONTROL_ROUTE_MODULES`), that take a method other than a read (GET, HEAD, OPTIONS)."""
    paths = set()
    for route in getattr(app, "routes", ()):
        module = getattr(getattr(route, "endpoint", None), "__module__", "") or ""
        methods = set(getattr(route, "methods", None) or ()) - {"GET", "HEAD", "OPTIONS"}
        if methods and module.startswith(CONTROL_ROUTE_MODULES):
            paths.add(route.path)
    return frozenset(paths)
