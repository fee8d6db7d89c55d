"""EngineCore side of a full-weight (base) update: staged, then committed between two steps.

A base update goes through the same books as a LoRA slot update (`slot_updates`), under the
registry's key `slot_registry.BASE` and the LoRA id `BASE_ID`: engine 0 admits it
(`art_reserve_update`: operation-id replay, compare-and-swap on the base version, one at a
time across API servers), and `art_commit_lora_update`, `art_revert_lora_update`,
`art_abort_lora_update` and `art_finish_update` take its token as they take a slot update's.
So the commit rides the next step (the base version, label and salts change right before the
batch that carries it is scheduled; every worker writes the staged weights in place before
that batch's forward, the tensor-parallel ranks agree, and a failure puts everything back),
a failure some worker could not undo blocks the base weights (every request is refused,
`blocked_slots`), and the version stays bound to its digest.

What differs is only the stage, here: the workers read the update's safetensors files into
host memory (`worker/base_weights.py`) instead of an adapter, or receive the trainer's stream
through their weight-transfer engine (the source is then a transfer plan), and the commit
ride names the directory of the weights it replaces, so a revert can read them again.
`art_init_weight_transfer` has every worker of this engine join the trainer's group (vLLM's
`/init_weight_transfer_engine` reaches engine 0 only with data parallelism: its
`collective_rpc` is a utility call on one engine).

While a base commit is open (committed, not finished) no other update stages on this engine,
and the other way round (`slot_updates.open_commits`): each revert puts back its own weights
and the label it replaced, which holds only when commits do not interleave.
"""

from __future__ import annotations

import os
import time

from art_protocol.checkpoint_layout import LayoutError, read_layout
from art_vllm_plugin import compat, stage_progress
from art_vllm_plugin.engine_core import slot_updates, step_rides
from art_vllm_plugin.engine_core.slot_registry import BASE, BASE_ID
from art_vllm_plugin.engine_core.state import StagedInEngine, engine_state


def art_stage_base_update(
    self, token: str, source: str | dict, version: int, marker_dir: str, digest: str | None
) -> dict:
    """Have every worker start staging the full weights: `source` is the directory the API
    server validated and wrote them to, or the plan of the trainer's stream (`digest` None:
    the stream's is only known once received). The workers leave their markers in
    `marker_dir`. Refused when `version` is not newer, was committed here before with another
    digest, or another update is committing here (`busy`: asked again)."""
    t0 = time.perf_counter()
    engine = engine_state(self)
    state = engine.updates
    if (refused := slot_updates.stale(state, BASE_ID, BASE, version)) is not None:
        return refused
    if not os.path.isdir(marker_dir):
        return slot_updates.unseen_stage(marker_dir)
    if (why := engine.registry.digests.refusal(BASE, version, digest)) is not None:
        return {"ok": False, "kind": "conflict", "error": why}
    if open_ids := slot_updates.open_commits(self, BASE_ID):
        return slot_updates.busy(open_ids)
    ride = step_rides.Ride(step_rides.BASE_STAGE, token, (source, marker_dir, digest))
    step_rides.queue(self, ride)
    ranks = list(range(compat.engine_worker_count(self)))
    engine.registry.digests.note_staged(BASE, token, digest)
    state.staged[token] = StagedInEngine(
        BASE_ID,
        BASE,
        version,
        ranks,
        time.perf_counter() - t0,
        markers=marker_dir,
        totals=_totals(source),
    )
    return {"ok": True, "ranks": ranks, "stall_ms": (time.perf_counter() - t0) * 1e3}


def _totals(source: str | dict) -> tuple[int, int] | None:
    """(bytes, tensors) of the update: from a stream's plan, or the stage's headers."""
    try:
        if isinstance(source, dict):
            return stage_progress.plan_totals(source)
        return stage_progress.layout_totals(read_layout(source))
    except (LayoutError, KeyError, ValueError):
        return None  # progress is shown without its total


def art_stage_progress(self, token: str | None = None) -> dict | None:
    """How far this engine's workers got staging the full-weight update `token` (None: the
    one staged here now, whichever API server runs it): `{"token", "version",
    "total_bytes", "total_tensors", "workers": [records]}`, each worker's progress record
    (`stage_progress`) read in the marker directory on this host, its age on this host's
    clock; None when no full-weight update stages here. Read by `GET /art/v1/weights` of an
    API server that does not run the update, and for an engine on another host by the one
    that does (its stall deadline)."""
    for t, staged in engine_state(self).updates.staged.items():
        if staged.name != BASE or staged.markers is None or token not in (None, t):
            continue
        total_bytes, total_tensors = staged.totals or (None, None)
        records = stage_progress.read(staged.markers, staged.ranks)
        return {
            "token": t,
            "version": staged.version,
            "total_bytes": total_bytes,
            "total_tensors": total_tensors,
            "workers": [records[r].to_json() for r in sorted(records)],
        }
    return None


def art_init_weight_transfer(self, init_info: dict) -> dict:
    """Every worker of this engine joins the trainer's weight-transfer group (blocks this
    engine's loop until they have: the trainer joins at the same time). The workers' ranks
    come from their DP index and rank, as vLLM's engines number them."""
    t0 = time.perf_counter()
    compat.engine_init_weight_transfer(self, init_info)
    return {
        "ok": True,
        "workers": compat.engine_worker_count(self),
        "ms": (time.perf_counter() - t0) * 1e3,
    }


def art_renew_update(self, token: str) -> dict:
    """The update `token` is still making progress (its stage receives bytes): push back
    this engine's limit on its life, `slot_registry.RESERVATION_TTL_S` (engine 0 would admit
    another update of its slot after that, and `abandoned_updates` would free what it
    staged). Sent by the API server every `slot_publish.RENEW_EVERY_S` while a full-weight
    stage progresses (`api_server/stage_deadline.py`), so a stream that keeps moving bytes is
    never taken for an abandoned one, however long it takes."""
    engine = engine_state(self)
    staged = engine.updates.staged.get(token)
    if staged is not None:
        staged.at = time.monotonic()
    return {"reservation": engine.registry.renew(token), "staged": staged is not None}


def art_base_staging(self) -> list[dict]:
    """Every worker's shard bytes, held undo bytes, staging place and commit path
    (`worker/base_weights.art_base_staging`), in rank order."""
    return list(compat.engine_executor(self).collective_rpc("art_base_staging"))
