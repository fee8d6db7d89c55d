"""vLLM names EngineCore code reaches to fail requests of a blocked slot with an error.

vLLM 0.32 `v1/engine/core.py`: `EngineCoreProc._send_error_outputs_to_client(req_ids,
client_index)` sends a finished output with `FinishReason.ERROR` to the API server that owns
the requests (what vLLM itself does for a request it could not pre-process); the API server's
handlers turn that finish reason into an error (`GenerationError`: a 500 body, or an error
event in a stream). `Scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)` removes
running and waiting requests and frees their KV blocks, as a client abort does between two
steps. Together they end a request the way vLLM's own `pause_scheduler(mode="abort")` ends
every request (finish in the scheduler, then one output per client).
"""

from __future__ import annotations

from collections import defaultdict

from art_vllm_plugin.compat import names
from art_vllm_plugin.compat.patching import load


def unfinished_request_ids_with_lora(scheduler, lora_int_ids) -> list[str]:
    """Ids of the unfinished requests (waiting, running, in a batch in flight) whose LoRA id
    is in `lora_int_ids` (`Scheduler.requests`)."""
    return [
        r.request_id
        for r in scheduler.requests.values()
        if r.lora_request is not None and r.lora_request.lora_int_id in lora_int_ids
    ]


def unfinished_request_ids(scheduler) -> list[str]:
    """Ids of every unfinished request (waiting, running, in a batch in flight)."""
    return list(scheduler.requests)


def fail_requests(core, request_ids: list[str]) -> int:
    """Finish `request_ids` with an error and tell their API servers; how many were ended."""
    status = load(names.REQUEST_STATUS_FINISHED_ERROR)
    ended = core.scheduler.finish_requests(request_ids, status)
    by_client: dict[int, list[str]] = defaultdict(list)
    for request in ended:
        by_client[request.client_index].append(request.request_id)
    for client_index, ids in by_client.items():
        core._send_error_outputs_to_client(ids, client_index)
    return len(ended)


def refuse_new_request(core, request) -> None:
    """Answer a request EngineCore was asked to add, without adding it: a finished output with
    an error, sent to its API server."""
    core._send_error_outputs_to_client([request.request_id], request.client_index)
