"""Worker side of an in-flight LoRA update: prepare (load + check), then commit (copy).

Added to vLLM's worker class as three methods that EngineCore calls with `collective_rpc`:

- `art_prepare_lora_update(lora_int_id, name, path)`: loads the adapter once from disk with
  vLLM's own loader (so vLLM's rank and module checks apply), packs it the way the manager
  packs registered adapters, and checks that every module's A/B fits the slot's stacked
  tensors. Nothing the model uses is touched; the result waits in `_art_pending`.
- `art_commit_lora_update(lora_int_id)`: replaces the registered CPU copy (so a later
  re-activation gets the new weights and nothing is re-read per step), and if the adapter is
  active in a slot index, copies the new A/B into that same index of every module
  (`set_lora`). Keeping the index keeps the punica mapping of running requests valid.
- `art_abort_lora_update(lora_int_id)`: drops a prepared update.
"""

from __future__ import annotations

from art_vllm_plugin import compat

_MARK = "__art_patched__"


class LoraUpdateError(ValueError):
    """The adapter does not fit the slot; the message names module and tensor."""


def _pending(worker) -> dict:
    return worker.__dict__.setdefault("_art_pending", {})


def _check_fits(manager, lora_model) -> None:
    for module_name, module in manager.modules.items():
        weights = manager._get_lora_layer_weights(lora_model, module_name)
        if not weights:
            continue
        a_list = weights.lora_a if isinstance(weights.lora_a, list) else [weights.lora_a]
        b_list = weights.lora_b if isinstance(weights.lora_b, list) else [weights.lora_b]
        for i, (a, b) in enumerate(zip(a_list, b_list, strict=False)):
            if a is None:
                continue
            a_slot = module.lora_a_stacked[i].shape  # [max_loras, 1, max_rank, in]
            b_slot = module.lora_b_stacked[i].shape  # [max_loras, 1, out, max_rank]
            if a.shape[0] > a_slot[2] or a.shape[1] != a_slot[3]:
                raise LoraUpdateError(
                    f"{module_name} slice {i}: lora_A shape {tuple(a.shape)} does not fit the "
                    f"slot (rank <= {a_slot[2]}, in_features {a_slot[3]})"
                )
            if b.shape[0] != b_slot[2] or b.shape[1] > b_slot[3]:
                raise LoraUpdateError(
                    f"{module_name} slice {i}: lora_B shape {tuple(b.shape)} does not fit the "
                    f"slot (out_features {b_slot[2]}, rank <= {b_slot[3]})"
                )


def art_prepare_lora_update(self, lora_int_id: int, lora_name: str, path: str) -> bool:
    worker_manager = compat.worker_lora_manager(self)
    manager = worker_manager._adapter_manager
    request = compat.lora_request(lora_name=lora_name, lora_int_id=lora_int_id, lora_path=path)
    lora_model = worker_manager._load_adapter(request)
    manager._create_merged_loras_inplace(lora_model)
    _check_fits(manager, lora_model)
    _pending(self)[lora_int_id] = lora_model
    return True


def art_commit_lora_update(self, lora_int_id: int) -> int | None:
    lora_model = _pending(self).pop(lora_int_id)
    manager = compat.worker_lora_manager(self)._adapter_manager
    manager._registered_adapters[lora_int_id] = lora_model
    if lora_int_id not in manager.lora_index_to_id:
        return None
    index = manager.lora_index_to_id.index(lora_int_id)
    for module_name, module in manager.modules.items():
        weights = manager._get_lora_layer_weights(lora_model, module_name)
        if weights:
            module.set_lora(index, weights.lora_a, weights.lora_b)
        else:
            module.reset_lora(index)
    return index


def art_abort_lora_update(self, lora_int_id: int) -> bool:
    return _pending(self).pop(lora_int_id, None) is not None


def install(worker_cls) -> None:
    if getattr(worker_cls, _MARK, False):
        return
    worker_cls.art_prepare_lora_update = art_prepare_lora_update
    worker_cls.art_commit_lora_update = art_commit_lora_update
    worker_cls.art_abort_lora_update = art_abort_lora_update
    setattr(worker_cls, _MARK, True)
