"""Every hook the plugin puts into vLLM, by process role, in the order it is applied.

One function per role lists its wrappers; nothing else in the plugin patches vLLM (each patch
is declared in `compat.patches` and applied through `compat.wrap`/`add`/`wrap_instance`,
which are idempotent and refuse anything undeclared). Feature modules supply the wrappers;
this module decides where they go and in which order.

Who calls what:

- `install_cli`: the general plugin, in every vLLM process, selected or not (`--plugin` must
  exist before anything is selected; inert until used).
- `install_selected_process`: `plugin_loader.activate`, in every process where `art` is
  selected. The general plugin cannot tell which process it runs in, so it applies the
  EngineCore and worker hooks everywhere (`install_engine_core`, `install_worker`: class
  patches, inert where the class is unused) and the plugin handover last.
- `install_api_server`: the endpoint plugin, when the API server's app starts (only the API
  server imports vLLM's OpenAI serving classes).
- `install_engine_scheduler`: per engine, before its first request (from a wrapper of
  `EngineCore.add_request`): that engine's scheduler records batch labels.

Feature modules are imported inside the functions: the general plugin imports this module in
every vLLM process, selected or not, and must stay cheap there.
"""

from __future__ import annotations

from collections.abc import Callable

from art_protocol.weight_transfer import GLOO_BACKEND, NIXL_BACKEND
from art_vllm_plugin import compat
from art_vllm_plugin.compat import patches as P


def is_active() -> bool:
    """Whether the plugin is switched on in this process: its hooks are in place (the plugin
    handover, applied last by `install_selected_process`, is)."""
    return compat.is_applied(P.PLUGIN_GROUPS)


def install_cli(on_select: Callable[[], None]) -> None:
    """Every process: `--plugin` and the `--art-*` options on the `vllm serve` parser."""
    from art_vllm_plugin import cli

    compat.wrap(P.CLI_OPTIONS, cli.add_serve_options(on_select))


def install_selected_process(plugin_handover: Callable) -> None:
    """Every process where `art` is selected (after the version check)."""
    from art_vllm_plugin import executor_guard, host_layout
    from art_vllm_plugin.routes import config as routes_config

    # 0.34's direct reload mode has no rollback: a failed full-weight write could not be
    # undone, so it is refused before anything starts (compat.refuse_direct_reload).
    compat.refuse_direct_reload()
    # Labels are exact only on tested executors: refused where arguments become a config.
    compat.wrap(P.EXECUTOR_GUARD, executor_guard.refuse_untested_executor)
    # Staged files must reach every worker: engines spanning hosts are refused there too.
    compat.wrap(P.HOST_LAYOUT_GUARD, host_layout.refuse_workers_across_hosts)
    # The config check runs wherever a VllmConfig is built (API server and EngineCore).
    compat.wrap(P.AUX_OUTPUT_CHECK, routes_config.worker_path_check(compat.routes_use_worker_path))
    install_engine_core()
    install_worker()
    # Last: its marker is what `is_active` reads, so a failure above leaves the plugin off.
    # Two bindings: vllm.plugins (looked up at call time by the endpoint loading) and the
    # stat-logger module's own (bound at its import; later imports bind the wrapper).
    compat.wrap(P.PLUGIN_GROUPS, plugin_handover)
    compat.wrap(P.PLUGIN_GROUPS_STAT_LOGGERS, plugin_handover)


def install_engine_core() -> None:
    """EngineCore: utility calls, cache salting, batch labels, CPU layout."""
    from art_vllm_plugin.engine_core import (
        abandoned_updates,
        adapter_streams,
        base_updates,
        batch_stamps,
        blocked_slots,
        cache_salting,
        commit_windows,
        core_pinning,
        figures_push,
        lease_records,
        lease_versions,
        relayed_stages,
        route_rows,
        slot_updates,
        step_rides,
        worker_hosts,
    )

    compat.add_all(P.SLOT_UPDATE_UTILITIES, slot_updates)
    compat.add_all(P.BASE_UPDATE_UTILITIES, base_updates)
    # A streamed LoRA adapter: every worker receives it, one writes it (then a push's update).
    compat.add_all(P.ADAPTER_STREAM_UTILITIES, adapter_streams)
    # Engine 0 holds the one commit window of a DP group whose experts span the engines.
    compat.add_all(P.COMMIT_WINDOW_UTILITIES, commit_windows)
    # Engines on another host stage from bytes sent in the call (relayed_stages.py).
    compat.add_all(P.RELAYED_STAGE_UTILITIES, relayed_stages)
    # Slot updates ride the next step; an engine that will not step sends them as an RPC.
    compat.wrap(P.ENGINE_RIDE_FLUSH, step_rides.flush_if_idle)
    # Updates an API server staged or committed and never ended free their workers' copies.
    compat.wrap(P.ENGINE_ABANDONED_SWEEP, abandoned_updates.sweep_after_input)
    compat.add_all(P.LEASE_UTILITIES, lease_versions)
    compat.add_all(P.LEASE_RECORD_UTILITIES, lease_records)
    # `add_request`: salting inside, scheduler stamping outside (the engine's scheduler is
    # stamped before its first request is salted, queued and scheduled).
    compat.wrap(P.ENGINE_SALT_REQUEST, cache_salting.salt_new_requests)
    compat.wrap(
        P.ENGINE_STAMP_SCHEDULER, batch_stamps.before_first_request(install_engine_scheduler)
    )
    compat.wrap(P.ENGINE_REFUSE_BLOCKED_SLOT, blocked_slots.refuse_requests_of_blocked_slots)
    compat.wrap(P.ENGINE_ATTACH_WEIGHT_VERSION, batch_stamps.attach_batch_label)
    # Each busy loop class defines its own `run_busy_loop`; DP engines inherit the utility.
    compat.wrap(P.BUSY_LOOP, core_pinning.layout_before_busy_loop)
    compat.wrap(P.DP_BUSY_LOOP, core_pinning.layout_before_busy_loop)
    compat.add(P.CPU_LAYOUT_UTILITY, core_pinning.art_cpu_layout)
    # Every worker on the engine's host (Ray may place them elsewhere): asked before step one.
    compat.wrap(P.WORKER_HOSTS_BUSY_LOOP, worker_hosts.hosts_before_busy_loop)
    compat.wrap(P.WORKER_HOSTS_DP_BUSY_LOOP, worker_hosts.hosts_before_busy_loop)
    # --art-routes: rows of the MoE layers only, whichever runner captured them.
    compat.wrap(P.ROUTE_LAYERS_BUSY_LOOP, route_rows.layers_before_busy_loop)
    compat.wrap(P.ROUTE_LAYERS_DP_BUSY_LOOP, route_rows.layers_before_busy_loop)
    compat.wrap(P.ROUTE_ROWS_ON_OUTPUTS, route_rows.cut_rows_on_outputs)
    # The cache salt is set once, where vLLM builds the Request (input thread); `add_request`
    # above only checks that no update committed since.
    compat.wrap(P.ENGINE_SALT_ON_PREPROCESS, cache_salting.salt_on_preprocess)
    # /art/metrics with several API servers: each engine pushes its figures to all of them.
    compat.add_all(P.FIGURES_UTILITIES, figures_push)
    compat.wrap(P.ENGINE_FIGURES_ON_OUTPUTS, figures_push.figures_on_outputs)
    compat.wrap(P.ENGINE_FIGURES_REGISTRY_PUSH, figures_push.push_registry_changes)


def install_engine_scheduler(core) -> None:
    """One engine, before its first request: its scheduler records each batch's label
    (`schedule`) and hands it to the batch's outputs (`update_from_output`)."""
    from art_vllm_plugin.engine_core import batch_stamps
    from art_vllm_plugin.engine_core.state import engine_state

    state = engine_state(core)
    scheduler = compat.engine_scheduler(core)
    compat.wrap_instance(P.SCHEDULER_SCHEDULE, scheduler, batch_stamps.stamp_schedule(core, state))
    compat.wrap_instance(
        P.SCHEDULER_UPDATE_FROM_OUTPUT, scheduler, batch_stamps.label_update_from_output(state)
    )
    state.stamps.scheduler_stamped = True


def install_worker() -> None:
    """Workers: slot updates (stage, swap, roll back), the committed-model loader, and on the
    CPU platform MoE LoRA and (`--art-routes`, vLLM with a V1 runner) route capture in the V1
    runner."""
    from art_vllm_plugin.routes import config as routes_config
    from art_vllm_plugin.worker import (
        base_weights,
        forward_labels,
        host_id,
        lora_slot_writer,
        route_layers,
        step_rides,
    )

    compat.add_all(P.WORKER_UTILITIES, lora_slot_writer)
    compat.add_all(P.WORKER_BASE_UTILITIES, base_weights)
    compat.add_all(P.WORKER_RIDE_UTILITY, step_rides)
    compat.add_all(P.WORKER_ROUTE_LAYER_IDS, route_layers)
    compat.add_all(P.WORKER_HOST_ID, host_id)
    # `--weight-transfer-config '{"backend": "art_gloo"}'` (or "art_nixl"): vLLM's factory
    # imports the engine when a worker loads its model (lazily: nothing is imported here, and
    # NIXL only when a trainer joins an art_nixl engine).
    compat.register_weight_transfer_engine(
        GLOO_BACKEND, "art_vllm_plugin.worker.gloo_transfer", "ArtGlooWeightTransferEngine"
    )
    compat.register_weight_transfer_engine(
        NIXL_BACKEND, "art_vllm_plugin.worker.nixl_transfer", "ArtNixlWeightTransferEngine"
    )
    # Each step's output carries the label of the weights its forward ran with.
    compat.wrap(P.WORKER_FORWARD_LABEL, forward_labels.label_forwards)
    compat.wrap(P.WORKER_SAMPLED_LABEL, forward_labels.label_sampled)
    compat.wrap(P.LOAD_COMMITTED_ADAPTER, lora_slot_writer.load_committed_adapter)
    # The worker-path capture lives in the CPU V1 runner, which 0.34 no longer has (Model
    # Runner V2's native capture serves routes there).
    if routes_config.selected() and compat.is_cpu_platform() and compat.has_v1_runner():
        from art_vllm_plugin.worker import route_capture

        compat.wrap(P.RUNNER_LOAD_MODEL, route_capture.bind_on_load)
        compat.wrap(P.RUNNER_EXECUTE_MODEL, route_capture.store_after_forward)
        compat.wrap(P.RUNNER_SAMPLE_TOKENS, route_capture.emit_after_sampling)
    if compat.is_cpu_platform() and not compat.has_v1_runner():
        from art_vllm_plugin.worker import punica_cpu_logits

        compat.wrap(P.CPU_PROMPT_LOGPROB_LORA, punica_cpu_logits.rows_by_token)
    if compat.is_cpu_platform():
        from art_vllm_plugin.worker import moe_lora_cpu

        compat.wrap(P.MOE_LORA_CONFIG_GUARD, moe_lora_cpu.refuse_at_config)
        compat.wrap(P.MOE_CONFIG_POST_INIT, moe_lora_cpu.keep_cpu_experts)
        compat.wrap(P.MOE_LORA_FORMAT, moe_lora_cpu.refuse_expert_weights)
        # A full-weight update of an MoE model: the experts' prepack on every write.
        from art_vllm_plugin.worker import cpu_moe_updates

        compat.wrap(P.CPU_MOE_UPDATE_PREPACK, cpu_moe_updates.prepack_on_updates)


def install_api_server() -> None:
    """The API server, at app start: policy spans, exact aliases, routed completions.

    Order where two wrappers share a method (the later one is outermost):
    - `create_completion` / `create_chat_completion`: the alias check, then the registry
      refresh outside it (the registry is re-read before the check reads it);
    - `request_output_to_completion_response` / `chat_completion_full_generator`: policy spans,
      then the routes tap outside it (independent: the tap only takes `routed_experts` off
      the outputs before vLLM would base64 them).
    """
    from art_vllm_plugin.api_server import (
        alias_requests,
        response_spans,
        route_completions,
        stock_lora_routes,
        stream_spans,
    )

    compat.wrap(P.STOCK_LORA_LOAD, stock_lora_routes.refuse_slot_names)
    compat.wrap(P.STOCK_LORA_UNLOAD, stock_lora_routes.refuse_slot_names)
    compat.wrap(P.COMPLETION_RESPONSE_SPANS, response_spans.spans_on_completion_choices)
    compat.wrap(P.COMPLETION_ALIAS_CHECK, alias_requests.serve_exact_alias)
    compat.wrap(P.CHAT_RESPONSE_SPANS, response_spans.spans_on_chat_choices)
    compat.wrap(P.CHAT_ALIAS_CHECK, alias_requests.serve_exact_alias)
    compat.wrap(P.SPANS_SO_FAR, stream_spans.spans_so_far)
    compat.wrap(P.COMPLETION_STREAM_SPANS, stream_spans.completion_stream_spans)
    compat.wrap(P.CHAT_STREAM_SPANS, stream_spans.chat_stream_spans)
    compat.wrap(P.COMPLETION_ALIAS_REFRESH, alias_requests.refresh_before_alias)
    compat.wrap(P.CHAT_ALIAS_REFRESH, alias_requests.refresh_before_alias)
    compat.wrap(P.COMPLETION_RESPONSE_ROUTES, route_completions.take_routes_from_completion)
    compat.wrap(P.CHAT_RESPONSE_ROUTES, route_completions.take_routes_from_chat)
    # Spans on every answer: beam-search beams get the labels of their step requests; prompt
    # logprobs that would end the engine (CPU LoRA kernels) are refused outermost, first.
    from art_vllm_plugin.api_server import beam_search_spans, request_refusals

    compat.wrap(P.BEAM_SEARCH_STEP_LABELS, beam_search_spans.record_step_labels)
    compat.wrap(P.BEAM_SEARCH_SPANS, beam_search_spans.spans_on_beams)
    compat.wrap(
        P.COMPLETION_PROMPT_LOGPROBS_GUARD, request_refusals.refuse_completion_prompt_logprobs
    )
    compat.wrap(P.CHAT_PROMPT_LOGPROBS_GUARD, request_refusals.refuse_chat_prompt_logprobs)
    # An MoE model over DP engines commits inside a pause of every engine (expert_cut): a
    # client's pause or resume waits for it.
    from art_vllm_plugin.api_server import expert_cut

    compat.wrap(P.CLIENT_PAUSE_HOLD, expert_cut.hold_client_pauses)
    compat.wrap(P.CLIENT_RESUME_HOLD, expert_cut.hold_client_pauses)
