"""EngineCore side of an in-flight LoRA slot update: one utility call, between two steps.

`art_update_lora_slot` is added to vLLM's `EngineCore` and called from the API server with
`call_utility_async`. vLLM runs utility calls in the busy loop between engine steps, so within
this one call, with no step in between, it:

1. asks every worker to *prepare* the adapter (load it from disk once, validate it against the
   slot's stacked tensors); if any worker fails, all drop what they prepared and the call fails
   with the first error, leaving weights and version untouched;
2. asks every worker to *commit* (copy into the slot's stacked tensors and replace the
   registered CPU copy) - a pure in-memory copy;
3. bumps the slot's version in the per-step label (see `art_vllm_plugin.provenance`).

Running requests are neither aborted nor preempted: their next step runs on the new weights and
is stamped with the new version. `art_steps` counts completed engine steps, so the returned
`step` is the step before which the new weights took effect.
"""

from __future__ import annotations

import time
from typing import Any

from art_vllm_plugin import compat
from art_vllm_plugin.engine_core import cache_salting
from art_vllm_plugin.provenance import encode_versions

_MARK = "__art_patched__"


def _art_state(core) -> dict[str, Any]:
    state = core.__dict__.get("_art_state")
    if state is None:
        state = {"versions": {}, "steps": 0, "updates": 0}
        core.__dict__["_art_state"] = state
    return state


def art_update_lora_slot(self, lora_int_id: int, lora_name: str, path: str, version: int):
    t0 = time.perf_counter()
    state = _art_state(self)
    current = state["versions"].get(lora_int_id, 0)
    if version <= current:
        raise ValueError(
            f"stale version {version} for slot {lora_name!r}: current is {current}; "
            "the update was not applied"
        )
    executor = self.model_executor
    try:
        executor.collective_rpc("art_prepare_lora_update", args=(lora_int_id, lora_name, path))
    except Exception:
        executor.collective_rpc("art_abort_lora_update", args=(lora_int_id,))
        raise
    executor.collective_rpc("art_commit_lora_update", args=(lora_int_id,))
    state["versions"][lora_int_id] = version
    state["updates"] += 1
    self._weight_version = encode_versions(state["versions"])
    resalted = cache_salting.resalt_waiting(self, lora_int_id, state["versions"])
    return {
        "step": state["steps"],
        "engine_ms": (time.perf_counter() - t0) * 1000.0,
        "versions": dict(state["versions"]),
        "resalted_waiting": resalted,
    }


def art_slot_state(self):
    """Versions, completed steps, update count and waiting requests, for tests and metrics."""
    state = _art_state(self)
    return {
        "versions": dict(state["versions"]),
        "steps": state["steps"],
        "updates": state["updates"],
        "label": self._weight_version,
        "waiting": sum(1 for _ in compat.waiting_requests(self.scheduler)),
    }


def install(engine_core_cls) -> None:
    """Add the utility methods and the step counter to vLLM's EngineCore (idempotent)."""
    if getattr(engine_core_cls, _MARK, False):
        return
    original_attach = engine_core_cls._attach_weight_version

    def _attach_weight_version(self, outputs):
        # Called exactly once per engine step, right after the step's outputs are made.
        _art_state(self)["steps"] += 1
        return original_attach(self, outputs)

    engine_core_cls._attach_weight_version = _attach_weight_version
    engine_core_cls.art_update_lora_slot = art_update_lora_slot
    engine_core_cls.art_slot_state = art_slot_state
    cache_salting.install(engine_core_cls, lambda core: _art_state(core)["versions"])
    setattr(engine_core_cls, _MARK, True)
