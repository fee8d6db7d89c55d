"""LoRA parameters in Megatron DDP's parameter all-gather (`overlap_param_gather`).

Why: with the distributed optimizer and `overlap_param_gather`, Megatron's optimizer step
updates only this DP rank's shard of each parameter and leaves the all-gather of the other
ranks' shards to a forward pre-hook that DDP registers on every module: it waits for (and
dispatches, then chains to the next) all-gather of the buckets holding that module's *own*
parameters (`DistributedDataParallel._make_forward_pre_hook`, megatron-core 0.19). A LoRA
slot's factors belong to its `LoraAdapter` module, but the delta is computed in the base
linear's forward hook, so nothing ever called the adapter and its pre-hook never fired: the
shards owned by other ranks stayed stale, ranks diverged from the second step on, and an
export right after a step published a half-updated adapter.

So the site reads a slot's factors by calling its adapter (`LoraAdapter.forward` returns
them): every forward pre-hook on it runs first, Megatron's included, exactly as for a
base module. We add no hook and name no Megatron internal: whatever Megatron's hook does
(wait, dispatch the next bucket group, skip under `align_param_gather`) happens as designed.

Megatron deliberately holds the all-gather back until the next forward, so a reader of the
trained weights between a step and the next forward (export, checkpoint, a comparison) must
finish it first: `finish_lora_param_sync(model)` does, by calling every adapter once.
"""

from __future__ import annotations

import torch

from .adapter import LoraAdapter


def lora_factors(adapter: LoraAdapter) -> tuple[torch.Tensor, torch.Tensor]:
    """`(a, b)` of `adapter`, after its forward pre-hooks (Megatron's param sync) have run."""
    return adapter()


def finish_slots_param_sync(adapters) -> int:
    """Finish the pending parameter all-gathers of `adapters` (in order); returns how many.

    Collective over each DP group where Megatron DDP overlaps the all-gather: every rank of
    the group must call it with the same adapters in the same order."""
    count = 0
    with torch.no_grad():  # as Megatron's own forced sync: a state update, not compute
        for adapter in adapters:
            lora_factors(adapter)
            count += 1
    return count


def finish_lora_param_sync(model: torch.nn.Module) -> int:
    """Finish every pending parameter all-gather of `model`'s LoRA parameters.

    Call it (every rank of the data-parallel group, in the same order: it may run the
    all-gather) before reading trained LoRA weights between an optimizer step and the next
    forward. `export_peft` calls it, and so does every site's `sharded_state_dict` (Megatron
    dist-checkpoint saves), for its own slots. Without Megatron DDP, or without
    `overlap_param_gather`, it costs one no-op call per slot. Returns the number of slots
    visited. `model` may be the DDP wrapper or the module it wraps.

    Like Megatron's own forced sync (`disable_forward_pre_hook`), it marks this iteration's
    all-gather as done until the next backward: call it after the optimizer step, not
    between a backward and the step (the step's update would then not be gathered).
    """
    from .sites import iter_lora_sites

    return finish_slots_param_sync(entry.adapter for entry in iter_lora_sites(model))
