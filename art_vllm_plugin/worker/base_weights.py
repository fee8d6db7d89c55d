"""Worker side of a full-weight (base) update: stage off the step loop, write in place between
two steps, put the previous weights back when told to.

- `stage`: on the worker's staging thread (`stager`), read the update's safetensors files
  (the stage directory the API server wrote, in the served model's Hugging Face names) into
  host memory, then leave `ready.<rank>` / `failed.<rank>` in the marker directory
  (`art_vllm_plugin.staging`). Nothing the model uses is touched.
- `commit_locked`: between two steps, under the weights lock a forward also holds (a ride:
  `step_rides`), write the staged tensors into the model in place through vLLM's layerwise
  reload (`compat.reload_weights_in_place`: the model's own `load_weights`, then each layer's
  weight processing again). LoRA slots stay as they are: their stacked tensors are separate
  from the base weights, and the reset that vLLM's `reload_weights` adds is not called. A
  failure writes the previous weights back before it answers.
- `rollback_locked`: puts back the previous weights of a commit that another worker or
  engine failed (all or nothing).

The undo is *where the previous weights can be read again*, not a copy of them: the served
model's own files (read as vLLM loaded them) for the start weights, else the directory of the
previous full-weight version, which the API server keeps while it is current
(`api_server/base_updates.py`). Why not a copy of the parameters: on CPU (and for quantized
models) the live tensors are processed forms (packed GEMM weights), which cannot be written
back as they are; a reload from checkpoint-format tensors always can. Cost: a revert reads the
previous weights again (a failure path only); a host copy of the update's tensors lives from
its stage to its commit.
"""

from __future__ import annotations

import functools

from art_protocol.checkpoint_layout import checkpoint_files
from art_vllm_plugin import compat, staging
from art_vllm_plugin.worker.stager import stage_in_background
from art_vllm_plugin.worker.state import BaseUndo, StagedBase, worker_state


def read_dir(checkpoint_dir: str):
    """(name, tensor) of every tensor of a safetensors checkpoint directory, a file at a time."""
    from safetensors.torch import load_file

    for path in checkpoint_files(checkpoint_dir):
        yield from load_file(str(path)).items()


def _stage(worker, staged: StagedBase, stage_dir: str, marker_dir: str, rank: int) -> None:
    try:
        state = worker_state(worker)
        if state.fault == "stage":
            state.fault = None
            raise RuntimeError(f"injected staging failure on rank {rank} (test hook)")
        staged.tensors = dict(read_dir(stage_dir))
        ok, message = True, ""
    except BaseException as exc:  # reported through the marker; the worker keeps serving
        staged.error = f"{type(exc).__name__}: {exc}"
        ok, message = False, f"engine\n{staged.error}"
    staging.mark(marker_dir, rank, ok, message)


def stage(worker, token: str, stage_dir: str, marker_dir: str) -> None:
    """Start reading the update in `stage_dir`; the marker goes to `marker_dir`."""
    rank = compat.worker_rank(worker)
    staged = worker_state(worker).staged_base[token] = StagedBase()
    stage_in_background(
        worker, functools.partial(_stage, worker, staged, stage_dir, marker_dir, rank)
    )


def _write_back(worker, source_dir: str | None) -> str | None:
    """Write the weights of `source_dir` (None: the served model's files) in place; None, or
    why that failed."""
    try:
        weights = compat.served_weights(worker) if source_dir is None else read_dir(source_dir)
        compat.reload_weights_in_place(worker, weights)
        return None
    except Exception as exc:
        where = source_dir or "the served model's files"
        return f"writing back the weights of {where} failed: {type(exc).__name__}: {exc}"


def commit_locked(worker, token: str, label: str | None, previous_dir: str | None) -> dict:
    """The in-place write, for a caller holding the weights lock. `label`: the policy label of
    the weights after it; `previous_dir`: where the weights it replaces can be read again."""
    state = worker_state(worker)
    rank = compat.worker_rank(worker)
    staged = state.staged_base.pop(token, None)
    if staged is None or staged.tensors is None:
        error = (staged and staged.error) or "nothing staged for this update"
        return {"ok": False, "rank": rank, "error": error, "restored": True}
    undo = BaseUndo(previous_dir, state.label)
    try:
        compat.reload_weights_in_place(worker, iter(staged.tensors.items()))
        if state.fault == "commit":
            state.fault = None
            raise RuntimeError(f"injected commit failure on rank {rank} (test hook)")
    except Exception as exc:
        return {
            "ok": False,
            "rank": rank,
            "error": f"{type(exc).__name__}: {exc}",
            "restored": _write_back(worker, previous_dir) is None,
        }
    if label is not None:
        state.label = label
    state.undo_base[token] = undo
    return {"ok": True, "rank": rank}


def rollback_locked(worker, token: str) -> dict:
    """Put back what the commit of `token` replaced here; the caller holds the weights lock."""
    state = worker_state(worker)
    rank = compat.worker_rank(worker)
    undo = state.undo_base.pop(token, None)
    if undo is None:
        return {"ok": True, "rank": rank, "restored": False}  # nothing was committed here
    if (error := _write_back(worker, undo.previous_dir)) is not None:
        return {"ok": False, "rank": rank, "error": error}
    state.label = undo.label
    return {"ok": True, "rank": rank, "restored": True}


def art_rollback_base_update(self, token: str) -> dict:
    """RPC form of `rollback_locked` (an engine reverting after another engine failed)."""
    with worker_state(self).weights_lock:
        return rollback_locked(self, token)
