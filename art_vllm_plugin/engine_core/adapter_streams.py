"""EngineCore side of a streamed LoRA update's first phase: have every worker receive the
trainer's stream (`worker/adapter_receive.py`), one of them writing the adapter's weights file
where the API server said. What follows is a push's update (`api_server/adapter_stream.py`).

The receive rides the next step like a stage (`step_rides`: no RPC, no drain), or goes as an
RPC at once when the engine will not step. Nothing of the engine's books changes: the update
is admitted, staged and committed afterwards through the slot books, as any LoRA update.
"""

from __future__ import annotations

import os

from art_vllm_plugin import compat
from art_vllm_plugin.engine_core import slot_updates, step_rides
from art_vllm_plugin.worker.step_rides import RECEIVE


def art_receive_adapter(
    self, token: str, plan: dict, marker_dir: str, write_dir: str | None
) -> dict:
    """Every worker of this engine receives stream `plan`; each leaves its marker in
    `marker_dir`, and worker 0 writes the weights file into `write_dir` (None: none does)."""
    if not os.path.isdir(marker_dir):
        return slot_updates.unseen_stage(marker_dir)
    step_rides.queue(self, step_rides.Ride(RECEIVE, token, (plan, marker_dir, write_dir)))
    return {"ok": True, "ranks": list(range(compat.engine_worker_count(self)))}
