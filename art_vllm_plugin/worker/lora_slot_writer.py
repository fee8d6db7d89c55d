"""Worker side of an in-flight LoRA update: stage off the step loop, swap at the step boundary.

Added to vLLM's worker class as methods that EngineCore calls with `collective_rpc`:

- `art_stage_lora_update(token, lora_int_id, name, stage_dir)`: starts a background thread
  that reads the staged copy of the adapter with vLLM's own loader (so vLLM's checks apply,
  with the slot's `is_3d_lora_weight`), packs it as registration would, cuts this rank's
  tensor-parallel shard of every layer on the host and checks it against the slot's stacked
  tensors (`slot_writes`, `slot_layout`; expert layers: `moe_slot_layout`) and, on a GPU,
  copies that shard alone to the device on a side stream. The call returns at once;
  the thread leaves `ready.<rank>` / `failed.<rank>` in the stage directory
  (`art_vllm_plugin.staging`). Nothing the model uses is touched.
- `art_commit_lora_update(token, label)`: the swap, between two engine steps, under the
  weights lock a forward also holds; the worker's label becomes `label` with it. The staged model
  becomes the slot's *committed* model (see below), replaces the CPU-cache entry, and, if the
  id is active at a stacked index, is copied into that same index (what `set_lora` writes,
  keeping the punica mapping of running requests valid; staged device tensors stay held
  until those copies ran: `staged_copies`). A failure restores this worker's previous
  weights before it answers. Never raises: returns `{"ok", "rank", "error", "restored"}`, so
  EngineCore sees every worker's answer (a raising worker would leave the other workers'
  answers unread in vLLM's response queues).
- `art_rollback_lora_update(token)`: puts back the previous weights of a commit that
  succeeded here but failed on another worker (all-or-nothing across workers).
- `art_abort_lora_update(token)`: drops a staged update.

**The committed version wins on every activation.** vLLM reloads a LoRA id from the path on
the *request* whenever the id is not in the worker's CPU cache (LRU eviction with more slots
than `--max-cpu-loras`, then re-activation). Requests admitted before an update carry the old
path, so a re-load would silently serve the old weights (or fail if the old directory is
gone). The worker therefore keeps each updated slot's committed `LoRAModel` in memory and
vLLM's loader returns it for that id, whatever path the request carries. Cost: one CPU copy
of each updated slot's adapter, also while it is out of vLLM's CPU cache.
"""

from __future__ import annotations

import functools
import os

from art_vllm_plugin import compat, staging
from art_vllm_plugin.compat import patches
from art_vllm_plugin.compat.worker import adapter_is_3d
from art_vllm_plugin.worker import slot_writes, staged_copies
from art_vllm_plugin.worker.slot_writes import SlotWrites
from art_vllm_plugin.worker.stager import stage_in_background
from art_vllm_plugin.worker.state import StagedUpdate, Undo, lora_manager_state, worker_state

#: Test-only fault hook: set only when the server runs with ART_TEST_HOOKS=1 (see
#: `art_test_inject_fault`); a commit on the named rank then fails after writing its weights,
#: or (kind "stage") the next staging on that rank fails as an engine error.
TEST_HOOKS_ENV = "ART_TEST_HOOKS"


def _stage_writes(manager, lora_model) -> SlotWrites:
    """This rank's writes, checked against the slots; on a GPU copied to the device on a
    side stream (this rank's shards only), so the commit's writes are device-to-device."""
    writes = slot_writes.plan(manager, lora_model)
    device = compat.lora_device(manager)
    if getattr(device, "type", "cpu") == "cuda":
        writes = staged_copies.copy_to_device(writes, device)
    return writes


def _read_staged_files(worker_manager, request):
    """vLLM's own loader and checks (`_load_adapter`), past the plugin's committed-model
    shortcut: the staged files themselves, never a cached model."""
    loader = compat.original_of(patches.LOAD_COMMITTED_ADAPTER, type(worker_manager)._load_adapter)
    return loader(worker_manager, request)


def _stage(worker, staged: StagedUpdate, request, marker_dir: str, rank: int) -> None:
    try:
        slots = worker_state(worker)
        if slots.fault == "stage":
            slots.fault = None
            raise RuntimeError(f"injected staging failure on rank {rank} (test hook)")
        worker_manager = compat.worker_lora_manager(worker)
        manager = compat.adapter_model_manager(worker_manager)
        model = _read_staged_files(worker_manager, request)
        compat.pack_adapter(manager, model)
        staged.writes = _stage_writes(manager, model)
        staged.model = model
        ok, message = True, ""
    except BaseException as exc:  # reported through the marker; the worker keeps serving
        # vLLM's adapter checks and ours raise ValueError: the adapter is at fault. Anything
        # else (memory, device, a bug) is the engine's problem, not the adapter's.
        kind = "adapter" if isinstance(exc, ValueError) else "engine"
        staged.error = f"{type(exc).__name__}: {exc}"
        message = f"{kind}\n{staged.error}"
        ok = False
    staged.done.set()
    staging.mark(marker_dir, rank, ok, message)


def art_stage_lora_update(
    self,
    token: str,
    lora_int_id: int,
    lora_name: str,
    stage_dir: str,
    marker_dir: str | None = None,
) -> int:
    """Start staging the adapter in `stage_dir`; the marker goes to `marker_dir` (one per DP
    engine; default `stage_dir`)."""
    staged_copies.IN_FLIGHT.release_done()
    slots = worker_state(self)
    slots.undo.clear()  # the previous update is final once the next one starts
    rank = compat.worker_rank(self)
    request = compat.lora_request(
        lora_name=lora_name,
        lora_int_id=lora_int_id,
        lora_path=stage_dir,
        is_3d_lora_weight=_slot_is_3d(self, lora_int_id),
    )
    staged = StagedUpdate(lora_int_id)
    slots.staged[token] = staged
    stage_in_background(
        self, functools.partial(_stage, self, staged, request, marker_dir or stage_dir, rank)
    )
    return rank


def _slot_is_3d(worker, lora_int_id: int) -> bool:
    """The slot's MoE layout flag (`is_3d_lora_weight`), from the version this worker holds:
    vLLM stamps it from the slot's request on every load, and a new version has the layout of
    the one it replaces (the API server checks its tensors against the slot's). False when
    the worker holds no version of the id (vLLM's default), or has no LoRA (the staging
    thread reports that)."""
    try:
        manager = compat.adapter_model_manager(compat.worker_lora_manager(worker))
    except RuntimeError:
        return False
    held = worker_state(worker).committed.get(lora_int_id)
    if held is None:
        held = compat.registered_adapter(manager, lora_int_id)
    return adapter_is_3d(held)


def _write_slot(manager, index: int, lora_model, writes: SlotWrites | None) -> None:
    """Staged writes (`slot_writes`), or a version put back: vLLM's `set_lora` with its
    weights, as `activate_adapter` writes them."""
    if writes is not None:
        slot_writes.write(manager, index, writes)
        return
    for module_name, module in compat.lora_modules(manager).items():
        weights = compat.module_lora_weights(manager, lora_model, module_name)
        if not weights:
            module.reset_lora(index)
            continue
        module.set_lora(index, weights.lora_a, weights.lora_b)


def _install_version(worker, lora_int_id: int, committed, registered, writes=None):
    """Make `committed` the id's weights everywhere on this worker (None: forget the id)."""
    state = worker_state(worker)
    worker_manager = compat.worker_lora_manager(worker)
    manager = compat.adapter_model_manager(worker_manager)
    compat.attach_state(worker_manager, state)  # vLLM's loader finds `committed` there
    if committed is None:
        state.committed.pop(lora_int_id, None)
    else:
        state.committed[lora_int_id] = committed
    if registered is not None:
        compat.replace_registered_adapter(manager, lora_int_id, registered)
    index = compat.lora_slot_index(manager, lora_int_id)
    if index is not None and registered is not None:
        _write_slot(manager, index, registered, writes)
    return index


def _hold_until_copied(manager, writes: SlotWrites | None) -> None:
    """Staged device tensors the commit's queued copies read stay referenced until those
    copies ran (`staged_copies`); host tensors need nothing."""
    if writes is not None and writes.device_bytes:
        done = staged_copies.copies_done_marker(compat.lora_device(manager))
        staged_copies.IN_FLIGHT.hold(slot_writes.tensors(writes), done)


def art_commit_lora_update(self, token: str, label: str | None = None) -> dict:
    """`label`: the policy label of the weights after this commit (EngineCore's encoding of
    every slot's version); the worker's forwards report it from the next one on
    (`forward_labels`). The swap holds the weights lock, so no forward runs inside it."""
    with worker_state(self).weights_lock:
        return commit_locked(self, token, label)


def commit_locked(self, token: str, label: str | None) -> dict:
    """The swap, for a caller that holds the weights lock (the RPC above, or a commit riding
    the step loop: `step_rides`)."""
    staged_copies.IN_FLIGHT.release_done()
    slots = worker_state(self)
    rank = compat.worker_rank(self)
    staged = slots.staged.pop(token, None)
    if staged is None or staged.model is None:
        error = (staged and staged.error) or "nothing staged for this update"
        return {"ok": False, "rank": rank, "error": error, "restored": True}
    lid = staged.lora_int_id
    worker_manager = compat.worker_lora_manager(self)
    manager = compat.adapter_model_manager(worker_manager)
    undo = Undo(lid, slots.committed.get(lid), compat.registered_adapter(manager, lid), slots.label)
    try:
        registered = staged.model if undo.registered is not None else None
        index = _install_version(self, lid, staged.model, registered, staged.writes)
        if slots.fault == "commit":
            slots.fault = None
            raise RuntimeError(f"injected commit failure on rank {rank} (test hook)")
    except Exception as exc:
        try:
            _install_version(self, lid, undo.committed, undo.registered)
            restored = True
        except Exception:
            restored = False
        _hold_until_copied(manager, staged.writes)
        return {
            "ok": False,
            "rank": rank,
            "error": f"{type(exc).__name__}: {exc}",
            "restored": restored,
        }
    _hold_until_copied(manager, staged.writes)
    if label is not None:
        slots.label = label
    slots.undo[token] = undo
    return {"ok": True, "rank": rank, "index": index}


def art_rollback_lora_update(self, token: str) -> dict:
    with worker_state(self).weights_lock:
        return rollback_locked(self, token)


def rollback_locked(self, token: str) -> dict:
    """Put back what the commit of `token` replaced here; the caller holds the weights lock."""
    staged_copies.IN_FLIGHT.release_done()
    rank = compat.worker_rank(self)
    slots = worker_state(self)
    undo = slots.undo.pop(token, None)
    if undo is None:
        return {"ok": True, "rank": rank, "restored": False}  # nothing was committed here
    try:
        _install_version(self, undo.lora_int_id, undo.committed, undo.registered)
    except Exception as exc:
        return {"ok": False, "rank": rank, "error": f"{type(exc).__name__}: {exc}"}
    slots.label = undo.label
    return {"ok": True, "rank": rank, "restored": True}


def art_abort_lora_update(self, token: str) -> bool:
    staged_copies.IN_FLIGHT.release_done()
    return worker_state(self).staged.pop(token, None) is not None


def art_test_inject_fault(self, kind: str, rank: int) -> bool:
    """Test-only (ART_TEST_HOOKS=1): on worker `rank`, kind "commit": the next commit fails
    after its writes; kind "stage": the next staging fails (an engine error, not the
    adapter's)."""
    if os.environ.get(TEST_HOOKS_ENV) != "1":
        return False
    if compat.worker_rank(self) == rank:
        worker_state(self).fault = kind
    return True


def load_committed_adapter(load_adapter):
    """Wrapper for `LRUCacheWorkerLoRAManager._load_adapter`: an updated id loads its
    committed model, whatever path the request carries (see the module docstring)."""

    def _load_adapter(self, lora_request):
        state = lora_manager_state(self)
        if state is not None and state.committed:
            model = state.committed.get(lora_request.lora_int_id)
            if model is not None:
                return model
        return load_adapter(self, lora_request)

    return _load_adapter
