"""vLLM names behind each engine's figures: reading a step's stats, and pushing them out.

vLLM 0.32 (`v1/core/sched/scheduler.py`, `update_from_output`) attaches a step's
`SchedulerStats` to the outputs of *one* client (API server) only: the first with outputs in
that step, else client 0. With several API servers the others never see that step, so each
engine sends its own figures to every API server that subscribed, on the channel below.

The channel: vLLM's output thread sends whatever the busy loop puts on
`EngineCoreProc.output_queue` as `(client_index, EngineCoreOutputs)` to that client. An
`EngineCoreOutputs` carrying a `utility_output` is handed by the client's output task to
`_process_utility_output`, which pops the awaiting object for its `call_id` from
`MPClient.utility_results` and calls its `set_result`. vLLM itself answers its own pushes that
way (`EEP_NOTIFICATION_CALL_ID`, `FT_STATUS_CALL_ID`: reserved negative ids; real calls use
non-negative ones). The plugin's receiver sits under `PUSH_CALL_ID` and puts itself back each
time. A client is only pushed to after it subscribed (the receiver is in place by then): an
unexpected call id would end the client's output task.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from art_vllm_plugin.compat import names
from art_vllm_plugin.compat.patching import load

logger = logging.getLogger("vllm.art_plugin.figures")

#: The reserved call id of the plugin's pushes ("Art"): negative, as vLLM's own pushes.
PUSH_CALL_ID = -0x417274


# --- reading a step (EngineCore and the API server's stat logger) -------------------------
def scheduler_stats_values(stats) -> tuple[int, int, int, float, int, int]:
    """(running, waiting, deferred waiting, KV usage, prefix queries, prefix hits) of one
    step's `SchedulerStats`; the prefix counts are the step's own."""
    prefix = stats.prefix_cache_stats
    return (
        stats.num_running_reqs,
        stats.num_waiting_reqs,
        stats.num_skipped_waiting_reqs,
        stats.kv_cache_usage,
        prefix.queries if prefix is not None else 0,
        prefix.hits if prefix is not None else 0,
    )


def iteration_stats_values(iteration_stats) -> tuple[int, int]:
    """(generation tokens, preempted requests) of one `IterationStats` (API server)."""
    return iteration_stats.num_generation_tokens, iteration_stats.num_preempted_reqs


def step_outputs_values(outputs: dict) -> tuple[object | None, int, int]:
    """(the step's `SchedulerStats` or None, generation tokens, preemptions) of one step's
    outputs (`dict[client_index, EngineCoreOutputs]`), counted as vLLM's `IterationStats`
    counts them: new token ids, and `PREEMPTED` events."""
    preempted_type = load(names.EVENT_PREEMPTED)
    stats, tokens, preempted = None, 0, 0
    for eco in outputs.values():
        if eco.scheduler_stats is not None:
            stats = eco.scheduler_stats
        for out in eco.outputs:
            tokens += len(out.new_token_ids)
            if out.events:
                preempted += sum(1 for e in out.events if e.type == preempted_type)
    return stats, tokens, preempted


# --- the push channel, engine end ----------------------------------------------------------
def engine_dp_rank(core) -> int:
    """The engine's DP rank (`EngineCoreProc.engine_index`; 0 in-process)."""
    return int(getattr(core, "engine_index", 0))


def engine_client_count(core) -> int:
    """How many API servers this engine answers (one output socket each); 1 for an engine
    without sockets (in-process)."""
    addresses = getattr(core, "addresses", None)
    return len(addresses.outputs) if addresses is not None else 1


def push_to_clients(core, clients, payload) -> None:
    """Queue `payload` for each client in `clients`; the output thread sends it."""
    outputs_cls = load(names.ENGINE_CORE_OUTPUTS)
    utility_output = load(names.UTILITY_OUTPUT)
    utility_result = load(names.UTILITY_RESULT)
    message = outputs_cls(
        utility_output=utility_output(PUSH_CALL_ID, result=utility_result(payload))
    )
    for client in clients:
        core.output_queue.put_nowait((client, message))


# --- the push channel, API-server end ------------------------------------------------------
def api_client_index(engine_client) -> int:
    """This API server's client index at the engines (`AsyncMPClient.client_index`)."""
    return int(getattr(engine_client.engine_core, "client_index", 0))


class _Receiver:
    """Stands where vLLM keeps a utility call's future; stays there after each push."""

    def __init__(self, results: dict, on_push: Callable[[object], None]):
        self.results = results
        self.on_push = on_push

    def set_result(self, value) -> None:
        self.results[PUSH_CALL_ID] = self
        try:
            self.on_push(value)
        except Exception:  # never into vLLM's output task: it would stop the API server
            logger.exception("art: an engine push could not be read")

    def set_exception(self, exc) -> None:
        self.results[PUSH_CALL_ID] = self
        logger.warning("art: an engine push failed: %s", exc)


def listen_for_pushes(engine_client, on_push: Callable[[object], None]) -> None:
    """Have `on_push(payload)` called, on this API server's event loop, for every push."""
    results = engine_client.engine_core.utility_results
    if not isinstance(results.get(PUSH_CALL_ID), _Receiver):
        results[PUSH_CALL_ID] = _Receiver(results, on_push)
