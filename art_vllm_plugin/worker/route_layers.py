"""Which layers a route row holds: the worker answers, because only it has the model.

`art_route_layer_ids` is a worker RPC (added to vLLM's `WorkerBase`): EngineCore asks it once
before its busy loop when routes are on (`engine_core/route_rows.py`), on either runner.
"""

from __future__ import annotations

from art_vllm_plugin import compat


def art_route_layer_ids(self) -> list[int]:
    """Global ids of this worker's MoE layers, ascending (the model's MoE layer order)."""
    return compat.moe_layer_ids(compat.worker_model(self))
