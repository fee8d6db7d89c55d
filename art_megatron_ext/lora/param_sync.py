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
finish it first: `sites.finish_lora_param_sync(model)` does, by calling every adapter once.
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
