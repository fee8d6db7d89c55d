"""Every vLLM function and method the plugin wraps, and every name it adds onto a vLLM class.

Declared once here (plain data, no vLLM import), applied only through `compat.wrap` /
`compat.add` / `compat.wrap_instance`, which refuse anything not listed in `ALL`. Where and
in which order each is applied: `art_vllm_plugin/install.py`, one function per process role.
`scripts/check_vllm_compat.py` checks these against another vLLM (docs/compat.md).
"""

from __future__ import annotations

from art_vllm_plugin.compat.declarations import (
    ADD,
    FROM_034,
    V1_RUNNER,
    VllmPatch,
    adds,
    collect,
)

_ENGINE = "vllm.v1.engine.core"
_COMPLETION = "vllm.entrypoints.openai.completion.serving"
_CHAT = "vllm.entrypoints.openai.chat_completion.serving"
#: The CPU V1 model runner; gone in 0.34 (Model Runner V2 only), so its patches are V1_RUNNER.
_RUNNER = "vllm.v1.worker.cpu_model_runner"

# --- every vLLM process, selected or not ------------------------------------------------
CLI_OPTIONS = VllmPatch(
    "vllm.engine.arg_utils",
    "EngineArgs.add_cli_args",
    by="cli.add_serve_options",
    why="the `vllm serve` parser gains --plugin and the --art-* options (a staticmethod)",
)

# --- every process where the plugin is selected ------------------------------------------
PLUGIN_GROUPS = VllmPatch(
    "vllm.plugins",
    "load_plugins_by_group",
    by="plugin_loader.with_art_plugins",
    why="hands vLLM the art endpoint plugin and stat logger when `art` is selected",
)
PLUGIN_GROUPS_STAT_LOGGERS = VllmPatch(
    "vllm.v1.metrics.loggers",
    "load_plugins_by_group",
    by="plugin_loader.with_art_plugins",
    why="the stat-logger module's own binding of load_plugins_by_group (bound at its import)",
    only_if_imported=True,
)
AUX_OUTPUT_CHECK = VllmPatch(
    "vllm.config",
    "VllmConfig._verify_aux_output_compatibility",
    by="routes.config.worker_path_check",
    why="--art-routes on the CPU V1 runner: our preconditions replace the MRV2 requirement",
)

# --- EngineCore -------------------------------------------------------------------------
ENGINE_STAMP_SCHEDULER = VllmPatch(
    _ENGINE,
    "EngineCore.add_request",
    by="engine_core.batch_stamps.before_first_request",
    why="before an engine's first request is scheduled, its scheduler is stamped",
)
ENGINE_SALT_REQUEST = VllmPatch(
    _ENGINE,
    "EngineCore.add_request",
    by="engine_core.cache_salting.salt_new_requests",
    why="a new request's salt (set at preprocessing) is re-set if an update committed since",
)
ENGINE_ATTACH_WEIGHT_VERSION = VllmPatch(
    _ENGINE,
    "EngineCore._attach_weight_version",
    by="engine_core.batch_stamps.attach_batch_label",
    why="a step's outputs carry the label of the batch they came from, not the current one",
)
SCHEDULER_SCHEDULE = VllmPatch(
    "vllm.v1.core.sched.scheduler",
    "Scheduler.schedule",
    by="engine_core.batch_stamps.stamp_schedule",
    why="records the label in force when each batch is scheduled (one engine's scheduler)",
    per_instance=True,
)
SCHEDULER_UPDATE_FROM_OUTPUT = VllmPatch(
    "vllm.v1.core.sched.scheduler",
    "Scheduler.update_from_output",
    by="engine_core.batch_stamps.label_update_from_output",
    why="hands the batch's recorded label to _attach_weight_version (one engine's scheduler)",
    per_instance=True,
)
BUSY_LOOP = VllmPatch(
    _ENGINE,
    "EngineCoreProc.run_busy_loop",
    by="engine_core.core_pinning.layout_before_busy_loop",
    why="applies the CPU core layout once workers are started and bound",
)
DP_BUSY_LOOP = VllmPatch(
    _ENGINE,
    "DPEngineCoreProc.run_busy_loop",
    by="engine_core.core_pinning.layout_before_busy_loop",
    why="the same for data-parallel engines (which define their own busy loop)",
)
ENGINE_RIDE_FLUSH = VllmPatch(
    _ENGINE,
    "EngineCoreProc._process_input_queue",
    by="engine_core.step_rides.flush_if_idle",
    why="slot-update rides queued for a step that will not come go to the workers as an RPC",
)
ENGINE_ABANDONED_SWEEP = VllmPatch(
    _ENGINE,
    "EngineCoreProc._process_input_queue",
    by="engine_core.abandoned_updates.sweep_after_input",
    why="updates staged or committed by an API server that never ended them free their copies",
)
CPU_LAYOUT_UTILITY = VllmPatch(
    _ENGINE,
    "EngineCoreProc.art_cpu_layout",
    by="engine_core.core_pinning",
    why="utility call: the CPUs EngineCore was confined to",
    kind=ADD,
)
SLOT_UPDATE_UTILITIES = adds(
    _ENGINE,
    "EngineCore",
    (
        "art_stage_lora_update",
        "art_commit_lora_update",
        "art_abort_lora_update",
        "art_revert_lora_update",
        "art_registry_register",
        "art_registry_snapshot",
        "art_reserve_update",
        "art_finish_update",
        "art_test_inject_fault",
        "art_test_hold_at_step",
        "art_slot_state",
        "art_block_slot",
    ),
    by="engine_core.slot_updates",
    why="utility calls of the two-phase slot update and the slot registry",
)
BASE_UPDATE_UTILITIES = adds(
    _ENGINE,
    "EngineCore",
    (
        "art_stage_base_update",
        "art_init_weight_transfer",
        "art_base_staging",
        "art_renew_update",
        "art_stage_progress",
    ),
    by="engine_core.base_updates",
    why="utility calls that stage a full-weight update (the rest goes through the slot books), "
    "join every worker of an engine to the trainer's weight-transfer group, say what a "
    "streamed version costs each worker, keep a long stage that progresses alive, and say how "
    "far its workers got",
)
ADAPTER_STREAM_UTILITIES = adds(
    _ENGINE,
    "EngineCore",
    ("art_receive_adapter",),
    by="engine_core.adapter_streams",
    why="utility call that has every worker receive a LoRA adapter the trainer streams, one "
    "of them writing it where the API server stages it (the update then goes as a push)",
)
COMMIT_WINDOW_UTILITIES = adds(
    _ENGINE,
    "EngineCore",
    ("art_take_commit_window", "art_give_commit_window"),
    by="engine_core.commit_windows",
    why="engine 0 holds the one commit window of its DP group (an MoE model's experts across "
    "engines), so API servers' windows and clients' pauses never overlap",
)
RELAYED_STAGE_UTILITIES = adds(
    _ENGINE,
    "EngineCore",
    (
        "art_stage_relayed",
        "art_stage_base_relayed",
        "art_receive_adapter_relayed",
        "art_stage_markers",
        "art_stage_ready_texts",
        "art_drop_relayed",
    ),
    by="engine_core.relayed_stages",
    why="utility calls that stage an update from bytes sent in the call, or a streamed "
    "full-weight update with its markers on the engine's own host (engines on other hosts)",
)
LEASE_RECORD_UTILITIES = adds(
    _ENGINE,
    "EngineCore",
    ("art_lease_version", "art_lease_begin", "art_lease_add", "art_lease_release"),
    by="engine_core.lease_records",
    why="utility calls that keep every API server's exact leases in engine 0's registry",
)
LEASE_UTILITIES = adds(
    _ENGINE,
    "EngineCore",
    ("art_lease_keep", "art_lease_pin", "art_lease_unpin"),
    by="engine_core.lease_versions",
    why="utility calls that pin an exact lease's LoRA id and label it with its version",
)

# --- workers ----------------------------------------------------------------------------
WORKER_UTILITIES = adds(
    "vllm.v1.worker.worker_base",
    "WorkerBase",
    (
        "art_stage_lora_update",
        "art_commit_lora_update",
        "art_rollback_lora_update",
        "art_abort_lora_update",
        "art_test_inject_fault",
    ),
    by="worker.lora_slot_writer",
    why="collective_rpc targets: stage off the step loop, swap between two steps",
)
WORKER_BASE_UTILITIES = adds(
    "vllm.v1.worker.worker_base",
    "WorkerBase",
    ("art_rollback_base_update", "art_base_staging"),
    by="worker.base_weights",
    why="collective_rpc targets: an engine reverts a full-weight commit another engine failed; "
    "a worker's shard bytes and commit path (staging budget, GET /art/v1/weights)",
)
WORKER_RIDE_UTILITY = adds(
    "vllm.v1.worker.worker_base",
    "WorkerBase",
    ("art_run_rides",),
    by="worker.step_rides",
    why="collective_rpc target: an idle engine's slot-update rides, run at once",
)
LOAD_COMMITTED_ADAPTER = VllmPatch(
    "vllm.lora.worker_manager",
    "LRUCacheWorkerLoRAManager._load_adapter",
    by="worker.lora_slot_writer.load_committed_adapter",
    why="an updated slot's id loads its committed weights, whatever path the request carries",
)
RUNNER_LOAD_MODEL = VllmPatch(
    _RUNNER,
    "CPUModelRunner.load_model",
    by="worker.route_capture.bind_on_load",
    why="binds the MoE route capture to the model's routers (--art-routes, CPU V1 runner)",
    checked=V1_RUNNER,
)
RUNNER_EXECUTE_MODEL = VllmPatch(
    _RUNNER,
    "CPUModelRunner.execute_model",
    by="worker.route_capture.store_after_forward",
    why="stores each forward's route rows by KV slot",
    checked=V1_RUNNER,
)
RUNNER_SAMPLE_TOKENS = VllmPatch(
    _RUNNER,
    "CPUModelRunner.sample_tokens",
    by="worker.route_capture.emit_after_sampling",
    why="attaches the rows to emit to the ModelRunnerOutput",
    checked=V1_RUNNER,
)
CPU_PROMPT_LOGPROB_LORA = VllmPatch(
    "vllm.lora.punica_wrapper.punica_cpu",
    "PunicaWrapperCPU.add_lora_logits",
    by="worker.punica_cpu_logits.rows_by_token",
    why="0.34 CPU: prompt-logprob logits rows take their tokens' adapter (MRV2's warm-up died)",
    checked=FROM_034,
)
MOE_CONFIG_POST_INIT = VllmPatch(
    "vllm.model_executor.layers.fused_moe.config",
    "FusedMoEConfig.__post_init__",
    by="worker.moe_lora_cpu.keep_cpu_experts",
    why="CPU build: LoRA that leaves the experts out keeps the CPU MoE kernel",
)
CPU_MOE_UPDATE_PREPACK = VllmPatch(
    "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method",
    "UnquantizedFusedMoEMethod.process_weights_after_loading",
    by="worker.cpu_moe_updates.prepack_on_updates",
    why="CPU build: a weight update's MoE layers get the experts' prepack vLLM skips on updates",
)
MOE_LORA_FORMAT = VllmPatch(
    "vllm.lora.model_manager",
    "LoRAModelManager._validate_moe_lora_format",
    by="worker.moe_lora_cpu.refuse_expert_weights",
    why="CPU build: an adapter with expert weights is refused, not silently dropped",
)

# --- API server -------------------------------------------------------------------------
SPANS_SO_FAR = VllmPatch(
    "vllm.v1.engine.output_processor",
    "RequestState._new_completion_output",
    by="api_server.stream_spans.spans_so_far",
    why="every CompletionOutput carries its weight-version spans so far (for streams)",
)
COMPLETION_STREAM_SPANS = VllmPatch(
    _COMPLETION,
    "OpenAIServingCompletion.completion_stream_generator",
    by="api_server.stream_spans.completion_stream_spans",
    why="policy_spans on each streamed completion chunk",
)
CHAT_STREAM_SPANS = VllmPatch(
    _CHAT,
    "OpenAIServingChat.chat_completion_stream_generator",
    by="api_server.stream_spans.chat_stream_spans",
    why="policy_spans on each streamed chat chunk",
)
COMPLETION_RESPONSE_SPANS = VllmPatch(
    _COMPLETION,
    "OpenAIServingCompletion.request_output_to_completion_response",
    by="api_server.response_spans.spans_on_completion_choices",
    why="policy_spans on every completion choice",
)
CHAT_RESPONSE_SPANS = VllmPatch(
    _CHAT,
    "OpenAIServingChat.chat_completion_full_generator",
    by="api_server.response_spans.spans_on_chat_choices",
    why="policy_spans on every chat choice",
)
STOCK_LORA_LOAD = VllmPatch(
    "vllm.entrypoints.openai.models.serving",
    "OpenAIServingModels.load_lora_adapter",
    by="api_server.stock_lora_routes.refuse_slot_names",
    why="stock /v1/load_lora_adapter on a slot name would report success and serve the old "
    "weights: refused (409) naming /art/v1/lora/update",
)
STOCK_LORA_UNLOAD = VllmPatch(
    "vllm.entrypoints.openai.models.serving",
    "OpenAIServingModels.unload_lora_adapter",
    by="api_server.stock_lora_routes.refuse_slot_names",
    why="stock /v1/unload_lora_adapter on a slot name: refused (409), a slot stays served",
)
COMPLETION_ALIAS_CHECK = VllmPatch(
    _COMPLETION,
    "OpenAIServingCompletion.create_completion",
    by="api_server.alias_requests.serve_exact_alias",
    why="model `slot@N` serves exactly version N or is refused (409)",
)
CHAT_ALIAS_CHECK = VllmPatch(
    _CHAT,
    "OpenAIServingChat.create_chat_completion",
    by="api_server.alias_requests.serve_exact_alias",
    why="model `slot@N` serves exactly version N or is refused (409)",
)
COMPLETION_ALIAS_REFRESH = VllmPatch(
    _COMPLETION,
    "OpenAIServingCompletion.create_completion",
    by="api_server.alias_requests.refresh_before_alias",
    why="an alias request first re-reads the slot registry from EngineCore",
)
CHAT_ALIAS_REFRESH = VllmPatch(
    _CHAT,
    "OpenAIServingChat.create_chat_completion",
    by="api_server.alias_requests.refresh_before_alias",
    why="an alias request first re-reads the slot registry from EngineCore",
)
COMPLETION_RESPONSE_ROUTES = VllmPatch(
    _COMPLETION,
    "OpenAIServingCompletion.request_output_to_completion_response",
    by="api_server.route_completions.take_routes_from_completion",
    why="/art/v1/completions takes the routed experts off the outputs for its bundle",
)
CHAT_RESPONSE_ROUTES = VllmPatch(
    _CHAT,
    "OpenAIServingChat.chat_completion_full_generator",
    by="api_server.route_completions.take_routes_from_chat",
    why="/art/v1/chat/completions takes the routed experts off the outputs for its bundle",
)

EXECUTOR_GUARD = VllmPatch(
    "vllm.engine.arg_utils",
    "EngineArgs.create_engine_config",
    by="executor_guard.refuse_untested_executor",
    why="refuses executors that do not keep steps and RPCs in one ordered queue (Ray's "
    "compiled graph)",
)
HOST_LAYOUT_GUARD = VllmPatch(
    "vllm.engine.arg_utils",
    "EngineArgs.create_engine_config",
    by="host_layout.refuse_workers_across_hosts",
    why="refuses engines whose workers span hosts (they could not see their stage)",
)
MOE_LORA_CONFIG_GUARD = VllmPatch(
    "vllm.engine.arg_utils",
    "EngineArgs.create_engine_config",
    by="worker.moe_lora_cpu.refuse_at_config",
    why="refuses LoRA reaching an MoE model's experts on CPU before any process loads the model",
)
CLIENT_PAUSE_HOLD = VllmPatch(
    "vllm.v1.engine.async_llm",
    "AsyncLLM.pause_generation",
    by="api_server.expert_cut.hold_client_pauses",
    why="a client's pause waits while an update's commit window holds MoE DP engines paused",
)
CLIENT_RESUME_HOLD = VllmPatch(
    "vllm.v1.engine.async_llm",
    "AsyncLLM.resume_generation",
    by="api_server.expert_cut.hold_client_pauses",
    why="a client's resume waits while an update's commit window holds MoE DP engines paused",
)

# -- every worker of an engine on its host (engine_core/worker_hosts.py) -------------------
WORKER_HOSTS_BUSY_LOOP = VllmPatch(
    _ENGINE,
    "EngineCoreProc.run_busy_loop",
    by="engine_core.worker_hosts.hosts_before_busy_loop",
    why="stops an engine whose Ray workers sit on other hosts (they could not see their stage)",
)
WORKER_HOSTS_DP_BUSY_LOOP = VllmPatch(
    _ENGINE,
    "DPEngineCoreProc.run_busy_loop",
    by="engine_core.worker_hosts.hosts_before_busy_loop",
    why="the same for data-parallel engines (which define their own busy loop)",
)
WORKER_HOST_ID = adds(
    "vllm.v1.worker.worker_base",
    "WorkerBase",
    ("art_host_id",),
    by="worker.host_id",
    why="collective_rpc target: the worker's host, checked against its engine's at start",
)

# -- route rows: the MoE layers only, on every runner (engine_core/route_rows.py) ----------
ROUTE_LAYERS_BUSY_LOOP = VllmPatch(
    _ENGINE,
    "EngineCoreProc.run_busy_loop",
    by="engine_core.route_rows.layers_before_busy_loop",
    why="--art-routes: asks the workers for the MoE layer ids once, before the first step",
)
ROUTE_LAYERS_DP_BUSY_LOOP = VllmPatch(
    _ENGINE,
    "DPEngineCoreProc.run_busy_loop",
    by="engine_core.route_rows.layers_before_busy_loop",
    why="the same for data-parallel engines (which define their own busy loop)",
)
ROUTE_ROWS_ON_OUTPUTS = VllmPatch(
    _ENGINE,
    "EngineCore._attach_weight_version",
    by="engine_core.route_rows.cut_rows_on_outputs",
    why="native capture (MRV2) rows cover every layer: cut to the MoE layers in the engine",
)
WORKER_ROUTE_LAYER_IDS = adds(
    "vllm.v1.worker.worker_base",
    "WorkerBase",
    ("art_route_layer_ids",),
    by="worker.route_layers",
    why="collective_rpc target: the model's MoE layer ids, from the loaded model",
)

# -- worker-recorded labels (worker/forward_labels.py) --------------------------------------
WORKER_FORWARD_LABEL = VllmPatch(
    "vllm.v1.worker.gpu_worker",
    "Worker.execute_model",
    by="worker.forward_labels.label_forwards",
    why="the forward runs under the weights lock and records the label of its weights",
)
WORKER_SAMPLED_LABEL = VllmPatch(
    "vllm.v1.worker.gpu_worker",
    "Worker.sample_tokens",
    by="worker.forward_labels.label_sampled",
    why="the sampled output carries the label of the forward that computed its logits",
)

# -- engine figures for /art/metrics, and the cache salt set once (issue 22 item 5) ----------
ENGINE_FIGURES_ON_OUTPUTS = VllmPatch(
    _ENGINE,
    "EngineCore._attach_weight_version",
    by="engine_core.figures_push.figures_on_outputs",
    why="with several API servers each engine adds its steps up and pushes them to all",
)
ENGINE_FIGURES_REGISTRY_PUSH = VllmPatch(
    _ENGINE,
    "EngineCoreProc._handle_client_request",
    by="engine_core.figures_push.push_registry_changes",
    why="a utility call that changed the slot registry pushes its generation at once",
)
FIGURES_UTILITIES = adds(
    _ENGINE,
    "EngineCore",
    ("art_figures_subscribe",),
    by="engine_core.figures_push",
    why="utility call: an API server subscribes to the engine's figures",
)
ENGINE_SALT_ON_PREPROCESS = VllmPatch(
    _ENGINE,
    "EngineCore.preprocess_add_request",
    by="engine_core.cache_salting.salt_on_preprocess",
    why="the cache salt is set before the Request hashes its prompt (input thread), once",
)

# -- blocked slots (engine_core/blocked_slots.py) -------------------------------------------
ENGINE_REFUSE_BLOCKED_SLOT = VllmPatch(
    _ENGINE,
    "EngineCore.add_request",
    by="engine_core.blocked_slots.refuse_requests_of_blocked_slots",
    why="a request on a slot whose update left its weights unknown ends with an error",
)

# -- spans on every answer: beam search, prompt logprobs (api_server/) -----------------------
BEAM_SEARCH_SPANS = VllmPatch(
    "vllm.entrypoints.generate.beam_search.online",
    "BeamSearchOnlineMixin.beam_search",
    by="api_server.beam_search_spans.spans_on_beams",
    why="vLLM assembles beam-search answers itself, without weight_versions: each beam gets "
    "the labels of the engine requests that sampled its tokens",
)
BEAM_SEARCH_STEP_LABELS = VllmPatch(
    "vllm.entrypoints.generate.beam_search.online",
    "collect_from_async_generator",
    by="api_server.beam_search_spans.record_step_labels",
    why="the beam-search module's own binding: records the label of each one-token engine "
    "request a beam search makes (its prompt is the beam so far)",
)
COMPLETION_PROMPT_LOGPROBS_GUARD = VllmPatch(
    _COMPLETION,
    "OpenAIServingCompletion.create_completion",
    by="api_server.request_refusals.refuse_completion_prompt_logprobs",
    why="prompt logprobs with --enable-lora on the CPU build end EngineCore: refused (400)",
)
CHAT_PROMPT_LOGPROBS_GUARD = VllmPatch(
    _CHAT,
    "OpenAIServingChat.create_chat_completion",
    by="api_server.request_refusals.refuse_chat_prompt_logprobs",
    why="prompt logprobs with --enable-lora on the CPU build end EngineCore: refused (400)",
)

#: Every declared patch; `compat.wrap`/`add`/`wrap_instance` refuse any other.
ALL: tuple[VllmPatch, ...] = collect(dict(globals()), VllmPatch)
