"""Exact leases in EngineCore: each pinned copy's LoRA id carries its fixed version in labels.

A lease (`api_server/leases.py`) serves version N of a slot from a separate, immutable LoRA
id. Its tokens must say version N in `policy_spans`, through the same machinery as slot
tokens: the per-batch label (`engine_core/batch_stamps.py`) is extended with
`<lease lora id>=N` for every pinned lease, so `provenance.slot_version` decodes N for the
lease's id (`LeaseLabels` in `engine_core/state.py`). Slot updates never touch these entries
(a lease's weights never change).

Utilities (run between engine steps, on every engine):

- `art_lease_keep(lora_int_id)`: pin the id in every worker's CPU LoRA cache (never evicted,
  so its weights stay the copy's whatever else is loaded). It is deliberately *not* pinned
  in a device slot (vLLM's `pin_lora` does both): a pinned device slot is one of the
  `--max-loras` slots the scheduler still counts as free, so a batch of `max_loras` other
  adapters would evict one of its own adapters and fail (KeyError in the punica mapping,
  HTTP 500). Unpinned there, the lease's id takes a device slot like any LoRA when scheduled
  and waits for one when all are in use;
- `art_lease_pin(lora_int_id, version)`: from the next scheduled batch on, label the id N;
- `art_lease_unpin(lora_int_id)`: stop labelling it, refused (`busy`) while a request that
  uses the id is still in the scheduler: its remaining tokens still need the label, and the
  API server removes the LoRA only after this succeeds.
"""

from __future__ import annotations

from typing import Any

from art_vllm_plugin import compat
from art_vllm_plugin.engine_core.state import engine_state


def _pin_in_cpu_cache(worker, lora_int_id: int) -> None:
    """Runs on each worker through `collective_rpc`."""
    compat.pin_lora_in_cpu_cache(worker, lora_int_id)


def art_lease_keep(self, lora_int_id: int) -> dict[str, Any]:
    compat.engine_executor(self).collective_rpc(_pin_in_cpu_cache, args=(int(lora_int_id),))
    return {"ok": True}


def art_lease_pin(self, lora_int_id: int, version: int) -> dict[str, Any]:
    engine_state(self).leases.pinned[int(lora_int_id)] = int(version)
    return {"ok": True}


def art_lease_unpin(self, lora_int_id: int) -> dict[str, Any]:
    busy = compat.scheduler_requests_with_lora(compat.engine_scheduler(self), int(lora_int_id))
    if busy:
        return {"ok": False, "busy": busy}
    engine_state(self).leases.pinned.pop(int(lora_int_id), None)
    return {"ok": True}
