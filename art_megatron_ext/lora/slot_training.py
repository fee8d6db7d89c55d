"""Which LoRA slots train and which stay frozen, declared before Megatron DDP wraps the model.

Why: Megatron's `DistributedDataParallel` puts every parameter that requires grad into its
gradient buffers when it is built, and the (distributed) optimizer then owns every one of
them. A slot that the steps never use breaks that contract. With `overlap_grad_reduce` its
gradients never arrive, so its bucket is never complete and the bucket's `reset()`
assertion fires at step 2; without overlap the optimizer hands it zero gradients and
AdamW's weight decay (and any leftover moments) still move a slot meant as a frozen
reference. A frozen slot must therefore not require grad when DDP and the optimizer are
built: then it is outside the buffers, outside the optimizer and outside Megatron's
parameter all-gather, and stays bit-identical across steps.

    apply_slot_training(model, SlotTraining(trained=("policy",), frozen=("reference",)))
    ddp = DistributedDataParallel(config, ddp_config, model)   # after, never before
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class SlotTrainingAfterWrap(RuntimeError):
    """A slot's trainability was changed after Megatron DDP built its gradient buffers."""


def _names(field: str, value) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (tuple, list)):
        raise TypeError(f"SlotTraining.{field} must be a tuple of slot names, got {value!r}")
    bad = [v for v in value if not isinstance(v, str) or not v]
    if bad:
        raise ValueError(f"SlotTraining.{field}: slot names must be non-empty strings, got {bad}")
    dup = sorted({v for v in value if value.count(v) > 1})
    if dup:
        raise ValueError(f"SlotTraining.{field} names {dup} more than once")
    return tuple(value)


@dataclass(frozen=True)
class SlotTraining:
    """Every slot of a model, split into the ones the optimizer updates and frozen ones.

    Args:
        trained: slots whose parameters require grad (in DDP's buffers and the optimizer).
        frozen: slots whose parameters do not (read-only, e.g. a reference policy); they
            can still be activated for forward passes.
    """

    trained: tuple[str, ...]
    frozen: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "trained", _names("trained", self.trained))
        object.__setattr__(self, "frozen", _names("frozen", self.frozen))
        both = sorted(set(self.trained) & set(self.frozen))
        if both:
            raise ValueError(f"SlotTraining: slots {both} are listed as both trained and frozen")


def _ddp_holds(param: torch.nn.Parameter) -> bool:
    """Megatron DDP gives each parameter of its gradient buffers a `main_grad` view."""
    return getattr(param, "main_grad", None) is not None


def apply_slot_training(model: torch.nn.Module, plan: SlotTraining) -> None:
    """Make the slots of `plan.trained` require grad and those of `plan.frozen` not.

    Call it before wrapping `model` in Megatron's `DistributedDataParallel` and building the
    optimizer. Every slot of the model must be named in `plan`, and every named slot must
    exist. Refused (`SlotTrainingAfterWrap`, nothing changed) when a slot would change while
    DDP already holds gradient buffers for the model's LoRA parameters; re-applying the same
    plan after wrapping is a no-op.
    """
    from .sites import iter_lora_sites

    entries = list(iter_lora_sites(model))
    present = {e.slot for e in entries}
    named = set(plan.trained) | set(plan.frozen)
    missing, unnamed = sorted(named - present), sorted(present - named)
    if missing or unnamed:
        raise ValueError(
            f"SlotTraining names slots the model lacks: {missing}; model slots it leaves "
            f"out: {unnamed} (the model has {sorted(present)}). No slot was changed."
        )
    trained = set(plan.trained)
    changes = [
        (e.slot, param, e.slot in trained)
        for e in entries
        for _, param in e.tensors
        if param.requires_grad != (e.slot in trained)
    ]
    wrapped = any(_ddp_holds(p) for e in entries for _, p in e.tensors)
    if changes and wrapped:
        slots = sorted({slot for slot, _, _ in changes})
        raise SlotTrainingAfterWrap(
            f"slots {slots} would change trainability after Megatron DDP built its gradient "
            "buffers; call apply_slot_training before DistributedDataParallel(...) and the "
            "optimizer are built (or rebuild both). Every slot keeps its current setting."
        )
    for _, param, requires_grad in changes:
        param.requires_grad_(requires_grad)


def trained_slots(model: torch.nn.Module) -> set[str]:
    """Names of the slots whose parameters require grad."""
    from .sites import iter_lora_sites

    return {e.slot for e in iter_lora_sites(model) if e.adapter.a.requires_grad}
