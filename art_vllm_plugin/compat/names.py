"""Every vLLM name the plugin reads, calls, imports or subclasses (without patching it).

Plain data, no vLLM import. The accessors in `compat/` load classes and functions through
these records (`compat.load`), and a test checks that every private attribute the accessors
touch is listed here, so `scripts/check_vllm_compat.py` sees all of them. Public config fields
read through documented objects (`vllm_config.lora_config.max_loras`, ...) are not listed.
"""

from __future__ import annotations

from art_vllm_plugin.compat.declarations import (
    BEFORE_034,
    FROM_034,
    V1_RUNNER,
    VllmName,
    collect,
)

_ENGINE = "vllm.v1.engine.core"
_CLIENT = "vllm.v1.engine.core_client"
_LORA_MODELS = "vllm.lora.model_manager"
#: The V1 model runner and its batch; gone in 0.34 (Model Runner V2 only): V1_RUNNER.
_GPU_RUNNER = "vllm.v1.worker.gpu_model_runner"
_BATCH = "vllm.v1.worker.gpu_input_batch"

# --- classes, functions and constants the plugin imports ---------------------------------
STAT_LOGGER_BASE = VllmName(
    "vllm.v1.metrics.loggers", "StatLoggerBase", "class", "the art stat logger subclasses it"
)
ENGINE_CORE = VllmName(_ENGINE, "EngineCore", "class", "its utility calls run between steps")
ENGINE_DEAD_ERROR = VllmName(
    "vllm.v1.engine.exceptions", "EngineDeadError", "class", "tells a dead engine from a failure"
)
LORA_REQUEST = VllmName("vllm.lora.request", "LoRARequest", "class", "leases and staged loads")
CURRENT_PLATFORM = VllmName(
    "vllm.platforms", "current_platform", "constant", "CPU-only behaviour (layout, MoE LoRA)"
)
ENDPOINT_PLUGINS_GROUP = VllmName(
    "vllm.plugins", "ENDPOINT_PLUGINS_GROUP", "constant", "which group the handover extends"
)
STAT_LOGGER_PLUGINS_GROUP = VllmName(
    "vllm.plugins", "STAT_LOGGER_PLUGINS_GROUP", "constant", "which group the handover extends"
)
AUX_REQUEST_OUTPUT = VllmName(
    "vllm.distributed.aux_output_connector.connector",
    "AuxRequestOutput",
    "class",
    "the rows a request emits in one step (route capture)",
)
MOE_RUNNER = VllmName(
    "vllm.model_executor.layers.fused_moe.layer", "MoERunner", "class", "finds MoE layer ids"
)
BIND_ROUTED_EXPERTS_CAPTURER = VllmName(
    "vllm.model_executor.layers.fused_moe.routed_experts_capturer",
    "bind_routed_experts_capturer",
    "function",
    "attaches the route capture to every MoE router",
)
COMPLETION_REQUEST = VllmName(
    "vllm.entrypoints.openai.completion.protocol",
    "CompletionRequest",
    "class",
    "/art/v1/completions validates its body with it",
)
CHAT_REQUEST = VllmName(
    "vllm.entrypoints.openai.chat_completion.protocol",
    "ChatCompletionRequest",
    "class",
    "/art/v1/chat/completions validates its body with it",
)
CURRENT_VLLM_CONFIG = VllmName(
    "vllm.config.vllm",
    "get_current_vllm_config_or_none",
    "function",
    "the config of the model being built (MoE LoRA on CPU)",
)

# --- API server: engine client, serving objects ------------------------------------------
ENGINE_CLIENT_CORE = VllmName(
    "vllm.v1.engine.async_llm", "AsyncLLM.engine_core", "attribute", "the engine-core client"
)
CALL_UTILITY = VllmName(
    _CLIENT, "AsyncMPClient.call_utility_async", "method", "a utility call on engine 0"
)
CALL_UTILITY_ON_ENGINE = VllmName(
    _CLIENT, "AsyncMPClient._call_utility_async", "method", "a utility call on one DP engine"
)
ENGINE_RANKS_MANAGED = VllmName(
    _CLIENT, "MPClient.engine_ranks_managed", "attribute", "DP ranks this API server manages"
)
CORE_ENGINES = VllmName(
    _CLIENT, "MPClient.core_engines", "attribute", "ZMQ identity of each managed engine"
)
CLIENT_COUNT = VllmName(
    _CLIENT, "AsyncMPClient.client_count", "attribute", "how many API servers share the engines"
)
DP_EXTERNAL_LB = VllmName(
    "vllm.config.parallel",
    "ParallelConfig.data_parallel_external_lb",
    "attribute",
    "external DP load balancing is refused",
)
DP_HYBRID_LB = VllmName(
    "vllm.config.parallel",
    "ParallelConfig.data_parallel_hybrid_lb",
    "attribute",
    "hybrid DP load balancing is refused",
)
SERVING_MODELS = VllmName(
    "vllm.entrypoints.serve.engine.serving",
    "BaseServing.models",
    "attribute",
    "the OpenAIServingModels every serving object shares: the API server state hangs on it",
)
CREATE_ERROR_RESPONSE = VllmName(
    "vllm.entrypoints.serve",
    "create_error_response",
    "function",
    "the ErrorResponse stock LoRA routes return (refusals on slot names)",
)
LORA_ID_COUNTER = VllmName(
    "vllm.entrypoints.openai.models.serving",
    "OpenAIServingModels.lora_id_counter",
    "attribute",
    "fresh LoRA ids for leases",
)
LORA_REQUESTS = VllmName(
    "vllm.entrypoints.openai.models.serving",
    "OpenAIServingModels.lora_requests",
    "attribute",
    "the served LoRA names (slots, leases)",
)
WEIGHT_VERSION_STARTS = VllmName(
    "vllm.v1.engine.output_processor",
    "RequestState.weight_version_starts",
    "attribute",
    "whether a request has version labels yet",
)
WEIGHT_VERSION_SPANS = VllmName(
    "vllm.v1.engine.output_processor",
    "RequestState._weight_version_spans",
    "method",
    "a request's weight-version spans so far (streams)",
)

# --- EngineCore internals ----------------------------------------------------------------
ENGINE_WEIGHT_VERSION = VllmName(
    _ENGINE, "EngineCore._weight_version", "attribute", "the label vLLM stamps on each step"
)
ENGINE_EXECUTOR = VllmName(_ENGINE, "EngineCore.model_executor", "attribute", "collective_rpc")
ENGINE_PAUSE_SCHEDULER = VllmName(
    _ENGINE,
    "EngineCore.pause_scheduler",
    "method",
    "test-only step hold (ART_TEST_HOOKS=1): freeze running requests as /pause?mode=keep does",
)
ENGINE_SCHEDULER = VllmName(_ENGINE, "EngineCore.scheduler", "attribute", "waiting queues")
ENGINE_BATCH_QUEUE = VllmName(
    _ENGINE, "EngineCore.batch_queue", "attribute", "batches in flight at a commit"
)
ENGINE_BATCH_QUEUE_SIZE = VllmName(
    _ENGINE, "EngineCore.batch_queue_size", "attribute", "reported by art_slot_state"
)
OUTPUT_WEIGHT_VERSION = VllmName(
    "vllm.v1.engine", "EngineCoreOutputs.weight_version", "attribute", "a step's label"
)
SCHEDULER_WAITING = VllmName(
    "vllm.v1.core.sched.scheduler", "Scheduler.waiting", "attribute", "re-salted at a commit"
)
SCHEDULER_KV_HOLDING_WAITING = VllmName(
    "vllm.v1.core.sched.scheduler",
    "Scheduler.kv_holding_waiting",
    "attribute",
    "waiting requests that hold KV, re-salted at a commit",
)
SCHEDULER_REQUESTS = VllmName(
    "vllm.v1.core.sched.scheduler",
    "Scheduler.requests",
    "attribute",
    "requests still using a lease's LoRA id",
)
REQUEST_BLOCK_HASHES = VllmName(
    "vllm.v1.request", "Request.block_hashes", "attribute", "recomputed after a re-salt"
)
REQUEST_UPDATE_BLOCK_HASHES = VllmName(
    "vllm.v1.request", "Request.update_block_hashes", "method", "recomputes the prompt hashes"
)
EXECUTOR_WORKERS = VllmName(
    "vllm.v1.executor.multiproc_executor",
    "MultiprocExecutor.workers",
    "attribute",
    "worker pids for the CPU layout",
)
WORKER_PROC = VllmName(
    "vllm.v1.executor.multiproc_executor", "WorkerProcHandle.proc", "attribute", "a worker's pid"
)
EXECUTOR_GET_CLASS = VllmName(
    "vllm.v1.executor.abstract",
    "Executor.get_class",
    "method",
    "which executor class a backend names (executor_guard)",
)
MULTIPROC_EXECUTOR = VllmName(
    "vllm.v1.executor.multiproc_executor",
    "MultiprocExecutor",
    "class",
    "one ordered queue for steps and RPCs: labels exact (executor_guard)",
)
UNIPROC_EXECUTOR = VllmName(
    "vllm.v1.executor.uniproc_executor",
    "UniProcExecutor",
    "class",
    "steps and RPCs on EngineCore's own thread: labels exact",
)

# --- workers: LoRA managers and the V1 runner ---------------------------------------------
WORKER_RANK = VllmName(
    "vllm.v1.worker.worker_base", "WorkerBase.rank", "attribute", "names a worker's marker"
)
WORKER_DEVICE = VllmName(
    "vllm.v1.worker.gpu_worker",
    "Worker.device",
    "attribute",
    "the plugin's staging threads set it as theirs at start, as vLLM's worker threads do",
)
WORKER_MODEL_RUNNER = VllmName(
    "vllm.v1.worker.gpu_worker", "Worker.model_runner", "attribute", "holds the LoRA manager"
)
RUNNER_LORA_MANAGER = VllmName(
    "vllm.v1.worker.lora_model_runner_mixin",
    "LoRAModelRunnerMixin.lora_manager",
    "attribute",
    "the worker's LRUCacheWorkerLoRAManager",
)
ADAPTER_MANAGER = VllmName(
    "vllm.lora.worker_manager",
    "LRUCacheWorkerLoRAManager._adapter_manager",
    "attribute",
    "the LRUCacheLoRAModelManager behind a worker LoRA manager",
)
PIN_LORA_IN_CPU_CACHE = VllmName(
    _LORA_MODELS,
    "LRUCacheLoRAModelManager._pin_lora_in_cpu_cache",
    "method",
    "pins a lease in the CPU cache without holding a device slot",
)
CREATE_MERGED_LORAS = VllmName(
    _LORA_MODELS,
    "LoRAModelManager._create_merged_loras_inplace",
    "method",
    "packs a staged adapter as registration does",
)
LORA_LAYER_WEIGHTS = VllmName(
    _LORA_MODELS,
    "LoRAModelManager._get_lora_layer_weights",
    "method",
    "one module's weights of a staged adapter",
)
REGISTERED_ADAPTERS = VllmName(
    _LORA_MODELS,
    "LoRAModelManager._registered_adapters",
    "attribute",
    "the CPU LoRA cache whose entry a commit replaces",
)
LORA_MODULES = VllmName(
    _LORA_MODELS, "LoRAModelManager.modules", "attribute", "the LoRA layers and stacked tensors"
)
LORA_INDEX_TO_ID = VllmName(
    _LORA_MODELS, "LoRAModelManager.lora_index_to_id", "attribute", "where an id is active"
)
LORA_DEVICE = VllmName(_LORA_MODELS, "LoRAModelManager.device", "attribute", "GPU staging")
LORA_MODEL_LORAS = VllmName(
    "vllm.lora.lora_model", "LoRAModel.loras", "attribute", "module names an adapter carries"
)
RUNNER_REQUESTS = VllmName(
    _GPU_RUNNER,
    "GPUModelRunner.requests",
    "attribute",
    "each request's KV block ids",
    checked=V1_RUNNER,
)
RUNNER_INPUT_BATCH = VllmName(
    _GPU_RUNNER,
    "GPUModelRunner.input_batch",
    "attribute",
    "the batch's request order",
    checked=V1_RUNNER,
)
RUNNER_KV_CACHE_CONFIG = VllmName(
    _GPU_RUNNER,
    "GPUModelRunner.kv_cache_config",
    "attribute",
    "KV blocks for the route store",
    checked=V1_RUNNER,
)
BATCH_REQ_IDS = VllmName(
    _BATCH, "InputBatch.req_ids", "attribute", "request order in a step", checked=V1_RUNNER
)
BATCH_COMPUTED = VllmName(
    _BATCH,
    "InputBatch.num_computed_tokens_cpu",
    "attribute",
    "where each request starts",
    checked=V1_RUNNER,
)
REQUEST_BLOCK_IDS = VllmName(
    _BATCH, "CachedRequestState.block_ids", "attribute", "a request's KV blocks", checked=V1_RUNNER
)
AUX_OUTPUT_METADATA = VllmName(
    "vllm.v1.core.sched.output",
    "SchedulerOutput.aux_output_connector_metadata",
    "attribute",
    "the first route row each request must emit",
)
AUX_OUTPUT = VllmName(
    "vllm.v1.outputs",
    "ModelRunnerOutput.aux_output_connector_output",
    "attribute",
    "the route rows a step emits",
)
USE_V2_MODEL_RUNNER = VllmName(
    "vllm.config.vllm",
    "VllmConfig.use_v2_model_runner",
    "attribute",
    "native or worker capture (0.34 has no choice: Model Runner V2 only)",
    checked=V1_RUNNER,
)

# --- engine figures for /art/metrics: a step's stats, the push channel (compat/figures.py) ---
ENGINE_CORE_OUTPUTS = VllmName(
    "vllm.v1.engine", "EngineCoreOutputs", "class", "a push to an API server is one"
)
OUTPUTS_SCHEDULER_STATS = VllmName(
    "vllm.v1.engine", "EngineCoreOutputs.scheduler_stats", "attribute", "the step's stats"
)
UTILITY_OUTPUT = VllmName("vllm.v1.engine", "UtilityOutput", "class", "carries a push")
UTILITY_RESULT = VllmName("vllm.v1.serial_utils", "UtilityResult", "class", "a push's payload")
EVENT_PREEMPTED = VllmName(
    "vllm.v1.engine", "EngineCoreEventType.PREEMPTED", "constant", "preemptions in a step"
)
SCHEDULER_STATS_DEFERRED = VllmName(
    "vllm.v1.metrics.stats",
    "SchedulerStats.num_skipped_waiting_reqs",
    "attribute",
    "requests waiting on something other than capacity",
)
ENGINE_OUTPUT_QUEUE = VllmName(
    _ENGINE, "EngineCoreProc.output_queue", "attribute", "(client, outputs) the output thread sends"
)
ENGINE_DP_RANK = VllmName(
    _ENGINE, "EngineCoreProc.engine_index", "attribute", "which engine's figures a push holds"
)
ENGINE_ADDRESSES = VllmName(
    _ENGINE, "EngineCoreProc.addresses", "attribute", "one output socket per API server"
)
PROCESS_UTILITY_OUTPUT = VllmName(
    _CLIENT,
    "_process_utility_output",
    "function",
    "pops the object under a call id and calls its set_result: the push receiver relies on it",
)
CLIENT_UTILITY_RESULTS = VllmName(
    _CLIENT, "MPClient.utility_results", "attribute", "where the push receiver waits"
)
CLIENT_INDEX = VllmName(
    _CLIENT, "AsyncMPClient.client_index", "attribute", "which API server the engines push to"
)

# -- worker-recorded labels (worker/forward_labels.py) --------------------------------------
ASYNC_MODEL_RUNNER_OUTPUT = VllmName(
    "vllm.v1.outputs",
    "AsyncModelRunnerOutput",
    "class",
    "an async step's output, made by get_output(): the label is attached then",
)
EMPTY_MODEL_RUNNER_OUTPUT = VllmName(
    "vllm.v1.outputs",
    "EMPTY_MODEL_RUNNER_OUTPUT",
    "constant",
    "vLLM's shared empty output: copied before it carries a label",
)

# -- blocked slots: requests of a slot left unknown fail (engine_core/blocked_slots.py) ------
SCHEDULER_FINISH_REQUESTS = VllmName(
    "vllm.v1.core.sched.scheduler",
    "Scheduler.finish_requests",
    "method",
    "ends the running and waiting requests of a blocked slot (frees their KV)",
)
REQUEST_STATUS_FINISHED_ERROR = VllmName(
    "vllm.v1.request",
    "RequestStatus.FINISHED_ERROR",
    "attribute",
    "the status they end with (the API server answers it as an error)",
)
REQUEST_CLIENT_INDEX = VllmName(
    "vllm.v1.request", "Request.client_index", "attribute", "which API server gets the error"
)
ENGINE_SEND_ERROR_OUTPUTS = VllmName(
    _ENGINE,
    "EngineCoreProc._send_error_outputs_to_client",
    "method",
    "tells the API server a request ended with an error (FinishReason.ERROR)",
)

# -- slot writes: what vLLM's `set_lora` writes, done by the plugin (worker/slot_layout.py) --
_LORA_LAYERS = "vllm.lora.layers"
_MOE_LORA = "vllm.lora.layers.fused_moe"
LINEAR_SET_LORA = VllmName(
    f"{_LORA_LAYERS}.base_linear",
    "BaseLinearLayerWithLoRA.set_lora",
    "method",
    "a layer whose set_lora is this one is written by the plugin (reset, TP slice, copy)",
)
MERGED_SET_LORA = VllmName(
    f"{_LORA_LAYERS}.column_parallel_linear",
    "MergedColumnParallelLinearWithLoRA.set_lora",
    "method",
    "the same, after expanding packed groups (expand_packed_lora)",
)
MOE_SET_LORA = VllmName(
    _MOE_LORA, "FusedMoEWithLoRA.set_lora", "method", "2-D expert LoRA written by the plugin"
)
MOE_3D_SET_LORA = VllmName(
    _MOE_LORA, "FusedMoE3DWithLoRA.set_lora", "method", "3-D expert LoRA written by the plugin"
)
LORA_A_STACKED = VllmName(
    f"{_LORA_LAYERS}.base_linear",
    "BaseLinearLayerWithLoRA.lora_a_stacked",
    "attribute",
    "a linear layer's A slots [max_loras, 1, rank, in] per slice",
)
LORA_B_STACKED = VllmName(
    f"{_LORA_LAYERS}.base_linear",
    "BaseLinearLayerWithLoRA.lora_b_stacked",
    "attribute",
    "a linear layer's B slots [max_loras, 1, out, rank] per slice",
)
MOE_W13_A = VllmName(
    _MOE_LORA, "FusedMoEWithLoRA.w13_lora_a_stacked", "attribute", "expert A slots (gate, up)"
)
MOE_W13_B = VllmName(
    _MOE_LORA, "FusedMoEWithLoRA.w13_lora_b_stacked", "attribute", "expert B slots (gate, up)"
)
MOE_W2_A = VllmName(
    _MOE_LORA, "FusedMoEWithLoRA.w2_lora_a_stacked", "attribute", "expert A slots (down)"
)
MOE_W2_B = VllmName(
    _MOE_LORA, "FusedMoEWithLoRA.w2_lora_b_stacked", "attribute", "expert B slots (down)"
)
MOE_ADAPTER_ENABLED = VllmName(
    _MOE_LORA,
    "FusedMoEWithLoRA.adapter_enabled",
    "attribute",
    "the expert kernels skip an index whose flag is 0 (set_lora sets it to 1)",
)
MOE_MATCH_EXPERT_DIM = VllmName(
    _MOE_LORA,
    "FusedMoEWithLoRA._match_expert_dim",
    "method",
    "collapses a shared factor to its buffer's expert dimension, as set_lora does",
)
MOE_SLICES = tuple(
    VllmName(_MOE_LORA, f"FusedMoEWithLoRA.{name}", "method", "this rank's expert shard")
    for name in ("_slice_w13_a", "_slice_w13_b", "_slice_w2_a", "_slice_w2_b")
)
LORA_MODEL_IS_3D = VllmName(
    "vllm.lora.lora_model",
    "LoRAModel.is_3d_lora_weight",
    "attribute",
    "a slot's MoE layout, carried into the request that stages its next version",
)

# -- spans on every answer: beam search, missing labels, prompt logprobs (api_server/) --------
WEIGHT_VERSION_SPAN = VllmName(
    "vllm.outputs",
    "WeightVersionSpan",
    "class",
    "a beam's labels, built from the labels of the engine requests that made its tokens",
)
REQUEST_STATE_EXTERNAL_ID = VllmName(
    "vllm.v1.engine.output_processor",
    "RequestState.external_req_id",
    "attribute",
    "the test-only label hook (ART_TEST_HOOKS=1) finds its marker in the request's id",
)
PLATFORM_PUNICA_WRAPPER = VllmName(
    "vllm.platforms.interface",
    "Platform.get_punica_wrapper",
    "method",
    "which LoRA kernels compute logits (prompt logprobs fail on the CPU ones with batches)",
)
CPU_PUNICA_WRAPPER = VllmName(
    "vllm.lora.punica_wrapper.punica_cpu",
    "PunicaWrapperCPU",
    "class",
    "its add_lora_logits fails on prompt logprobs when a batch holds two requests or more",
)

# -- slot updates riding the step loop (engine_core/step_rides.py, worker/step_rides.py) -----
GET_TP_GROUP = VllmName(
    "vllm.distributed.parallel_state",
    "get_tp_group",
    "function",
    "a commit riding a step: the tensor-parallel ranks agree on it (its CPU group)",
)
GET_PCP_GROUP = VllmName(
    "vllm.distributed.parallel_state",
    "get_pcp_group",
    "function",
    "a commit: the prefill-context-parallel ranks of the engine agree on it too (its CPU group)",
)
GET_PP_GROUP = VllmName(
    "vllm.distributed.parallel_state",
    "get_pp_group",
    "function",
    "a commit: the pipeline stages of the engine agree on it too (its CPU group)",
)

# -- full-weight updates (worker/base_weights.py) ---------------------------------------------
INITIALIZE_LAYERWISE_RELOAD = VllmName(
    "vllm.model_executor.model_loader.reload.layerwise",
    "initialize_layerwise_reload",
    "function",
    "a base update writes in place as reload_weights does, without its reset_lora_state()",
    checked=BEFORE_034,
)
FINALIZE_LAYERWISE_RELOAD = VllmName(
    "vllm.model_executor.model_loader.reload.layerwise",
    "finalize_layerwise_reload",
    "function",
    "re-runs each layer's process_weights_after_loading (CPU GEMM packing, quantization)",
    checked=BEFORE_034,
)
# 0.34: a reload begins and ends through these (`reload/lifecycle.py`), which pick the mode
# VLLM_RELOAD_MODE selects and keep `weight_update_active()` (read by models' load_weights).
START_RELOAD = VllmName(
    "vllm.model_executor.model_loader.reload",
    "start_reload",
    "function",
    "a base update begins its in-place write as vLLM's reload_weights does (0.34)",
    checked=FROM_034,
)
FINISH_RELOAD = VllmName(
    "vllm.model_executor.model_loader.reload",
    "finish_reload",
    "function",
    "re-runs each layer's weight processing and ends the update (0.34: takes the device)",
    checked=FROM_034,
)
RELOAD_MODE = VllmName(
    "vllm.envs",
    "VLLM_RELOAD_MODE",
    "constant",
    "the direct mode has no rollback, so the plugin refuses it at start (0.34)",
    checked=FROM_034,
)
KV_CACHE_LENT_FOR_WEIGHT_UPDATE = VllmName(
    "vllm.v1.worker.extensible_kv_cache",
    "kv_cache_lent_for_weight_update",
    "function",
    "an in-place write's layer rebuild runs with the KV cache's memory cap lifted (0.34)",
    checked=FROM_034,
)
RUNNER_EXTENSIBLE_KV_CACHE = VllmName(
    "vllm.v1.worker.gpu.model_runner",
    "GPUModelRunner.extensible_kv_cache",
    "attribute",
    "the KV cache that caps torch's memory (None for a standard one)",
    checked=FROM_034,
)
WORKER_KV_CACHE_RECLAIMABLE = VllmName(
    "vllm.v1.worker.gpu_worker",
    "Worker._kv_cache_reclaimable",
    "attribute",
    "whether the KV cache's memory may be lent to a weight write (nothing in it to keep)",
    checked=FROM_034,
)
_LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"
_RELOAD_INFO = "vllm.model_executor.model_loader.reload.types"
GET_LAYERWISE_INFO = VllmName(
    _LAYERWISE,
    "get_layerwise_info",
    "function",
    "a failed in-place write is undone layer by layer (each layer's reload state)",
)
PLACE_KERNEL_TENSORS = VllmName(
    _LAYERWISE,
    "_place_kernel_tensors",
    "function",
    "puts back the tensors the forward reads on a layer a failed write left armed",
)
RELOAD_INFO_CAN_LOAD = VllmName(
    _RELOAD_INFO, "LayerReloadingInfo.can_load", "method", "whether a layer is still armed"
)
RELOAD_INFO_KERNEL_TENSORS = VllmName(
    _RELOAD_INFO,
    "LayerReloadingInfo.kernel_tensors",
    "attribute",
    "the tensors the forward reads, kept while a layer reloads",
)
RELOAD_INFO_RESET = VllmName(
    _RELOAD_INFO, "LayerReloadingInfo.reset", "method", "disarms a layer a failed write left armed"
)
# -- a worker's shard of a streamed version, and its commit (compat/shard_forms.py) ------------
_RELOAD_META = "vllm.model_executor.model_loader.reload.meta"
RESTORE_LAYER_REFS = VllmName(
    "vllm.model_executor.model_loader.reload.sanitize",
    "restore_layer_refs",
    "function",
    "a staging tensor's weight loader is bound to the layer it loads for (the shard stage)",
)
RESTORE_LAYER_ON_META = VllmName(
    _RELOAD_META,
    "restore_layer_on_meta",
    "function",
    "a processed layer is rebuilt in its loaded form from the staged shard (the commit)",
)
MATERIALIZE_LAYER = VllmName(
    _RELOAD_META, "materialize_layer", "function", "the rebuilt layer's tensors get memory"
)
GET_LAYER_PARAMS_BUFFERS = VllmName(
    "vllm.model_executor.model_loader.reload.utils",
    "get_layer_params_buffers",
    "function",
    "the tensors the forward reads, kept while a processed layer is rebuilt",
)
COPY_AND_RESTORE_KERNEL_TENSORS = VllmName(
    _LAYERWISE,
    "_copy_and_restore_kernel_tensors",
    "function",
    "the rebuilt layer's processed values go into the tensors the forward reads",
)
GET_ORIGINAL_LOADER = VllmName(
    _LAYERWISE,
    "_get_original_loader",
    "function",
    "a staging tensor takes the loader vLLM made, without the layerwise wrapper that a reload "
    "leaves on the recorded loaded form (it would drop every tensor as excessive loading)",
)
CPU_UNQUANTIZED_EXPERTS = VllmName(
    "vllm.model_executor.layers.fused_moe.experts.cpu_moe",
    "CPUUnquantizedExperts",
    "class",
    "a rebuilt MoE layer on CPU needs its experts' prepack, which vLLM skips on weight updates",
)
QUANTIZE_METHOD_BASE = VllmName(
    "vllm.model_executor.layers.quantization.base_config",
    "QuantizeMethodBase",
    "class",
    "a layer with weight processing (its quant_method) cannot take a plain copy unless probed",
)
IS_DEFERRED_ATTENTION_LAYER = VllmName(
    "vllm.model_executor.layers.attention",
    "is_deferred_attention_layer",
    "function",
    "attention layers are processed with the model config: never a plain copy",
)
SET_CURRENT_VLLM_CONFIG = VllmName(
    "vllm.config.vllm",
    "set_current_vllm_config",
    "function",
    "the in-place write runs in vLLM's config context, as vLLM's reloads do (weight "
    "processing reads it: FP8 MoE kernels, DeepEP all2all set-up)",
)
GET_MODEL_LOADER = VllmName(
    "vllm.model_executor.model_loader",
    "get_model_loader",
    "function",
    "a revert to the served weights reads them as vLLM loaded them (get_all_weights)",
)

# -- full-weight streams (worker/gloo_transfer.py, worker/base_weights.py) -------------------
WEIGHT_TRANSFER_ENGINE = VllmName(
    "vllm.distributed.weight_transfer.base",
    "WeightTransferEngine",
    "class",
    "the art_gloo engine subclasses it; a staged stream retargets any engine at a host sink",
)
WEIGHT_TRANSFER_FACTORY = VllmName(
    "vllm.distributed.weight_transfer.factory",
    "WeightTransferEngineFactory",
    "class",
    "register_engine (art_gloo) and its _registry (registered once per process)",
)
WEIGHT_TRANSFER_REGISTRY = VllmName(
    "vllm.distributed.weight_transfer.factory",
    "WeightTransferEngineFactory._registry",
    "attribute",
    "whether art_gloo is registered already (register_engine refuses a name twice)",
)
WORKER_WEIGHT_TRANSFER_ENGINE = VllmName(
    "vllm.v1.worker.gpu_worker",
    "Worker.weight_transfer_engine",
    "attribute",
    "the engine built at load_model from --weight-transfer-config, which a stage receives on",
)
WORKER_INIT_WEIGHT_TRANSFER = VllmName(
    "vllm.v1.worker.gpu_worker",
    "Worker.init_weight_transfer_engine",
    "method",
    "every worker of every DP engine joins the trainer's group (vLLM's route reaches engine 0)",
)
#: Every declared name.
ALL: tuple[VllmName, ...] = collect(dict(globals()), VllmName)
