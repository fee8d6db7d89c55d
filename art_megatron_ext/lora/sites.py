"""The one iterator over every LoRA tensor of a model, and padding cleanup built on it.

Why one iterator: anything that must touch every LoRA tensor (padding cleanup, export,
checkpointing, optimizer set-up) walks `iter_lora_sites`, so a new kind of site or a slot added
after the optimizer was built cannot be missed by one of them. (A peer project kept legacy
single-adapter parameters and dynamic-slot parameters in two places; its padding cleanup
walked only one, and the padded gradients of dynamic slots drifted.) Here the adapter created
at attach time is simply the slot named `default`, stored like every other slot.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .adapter import LoraAdapter
from .padding import logical_shape, zero_mask_of, zero_optimizer_padding_, zero_padding_
from .param_sync import finish_slots_param_sync
from .site import LoraSite


@dataclass(frozen=True)
class LoraSiteSlot:
    """One slot at one site: its tensors with their logical and padded shapes."""

    path: str
    kind: str
    slot: str
    site: LoraSite
    adapter: LoraAdapter

    @property
    def tensors(self) -> tuple[tuple[str, torch.nn.Parameter], ...]:
        return (("a", self.adapter.a), ("b", self.adapter.b))

    @property
    def a_logical(self) -> tuple[int, ...]:
        return logical_shape(self.adapter.a)

    @property
    def b_logical(self) -> tuple[int, ...]:
        return logical_shape(self.adapter.b)

    @property
    def b_zero_mask(self):
        """Structural zeros of a stacked fused slot's B ([rows_pad, r_pad] bool), or None."""
        return zero_mask_of(self.adapter.b)

    @property
    def a_padded(self) -> tuple[int, ...]:
        return tuple(self.adapter.a.shape)

    @property
    def b_padded(self) -> tuple[int, ...]:
        return tuple(self.adapter.b.shape)


def iter_lora_sites(model: torch.nn.Module) -> Iterator[LoraSiteSlot]:
    """Every (site, slot) of `model`, sites in module order, slots in insertion order.

    Covers dense and grouped sites and every slot, whenever it was added.
    """
    for module in model.modules():
        if isinstance(module, LoraSite):
            for slot, adapter in module.slots.items():
                yield LoraSiteSlot(module.info.path, module.info.kind, slot, module, adapter)


LOW_PRECISION = (torch.bfloat16, torch.float16)


class LoraPrecisionError(ValueError):
    """A low-precision LoRA parameter would be updated in place by a plain torch optimizer."""


def check_lora_optimizer_precision(model: torch.nn.Module, optimizer) -> None:
    """Raise `LoraPrecisionError` if a plain torch optimizer steps a bf16/fp16 LoRA parameter.

    Why: a torch optimizer adds its update to the parameter in the parameter's dtype. With
    bf16 (8 significant bits) an update smaller than about 1/256 of the weight rounds away, so
    small LoRA learning rates silently stop training. Megatron's optimizers keep fp32 main
    params and are accepted, as are fp32 LoRA parameters (`LoraConfig(dtype=torch.float32)`)
    and parameters the optimizer does not hold. Nothing is changed either way.
    """
    if optimizer is None or type(optimizer).__module__.startswith("megatron."):
        return
    held = {id(p) for group in getattr(optimizer, "param_groups", ()) for p in group["params"]}
    for entry in iter_lora_sites(model):
        for name, param in entry.tensors:
            if param.dtype in LOW_PRECISION and id(param) in held:
                raise LoraPrecisionError(
                    f"LoRA parameter {entry.path}.lora.slots.{entry.slot}.{name} is "
                    f"{param.dtype} and {type(optimizer).__name__} updates it in that dtype, "
                    "where small updates round away; use fp32 LoRA parameters "
                    "(LoraConfig(dtype=torch.float32)) or Megatron's optimizer (fp32 main "
                    "params). Nothing was changed."
                )


def zero_lora_padding_(model: torch.nn.Module, optimizer=None) -> int:
    """Zero the padded regions (and structural zeros of stacked fused slots) of every LoRA
    parameter, its `.grad` and `main_grad`.

    With `optimizer`, the same regions of what it keeps for each parameter are zeroed too:
    per-parameter state tensors (Adam moments) of a torch optimizer, and the flat main-param,
    grad and moment shards of Megatron's `DistributedOptimizer`. Call it after backward (before
    the step) and after the step. Returns the number of parameters visited.

    A plain torch optimizer holding a bf16/fp16 LoRA parameter is refused first
    (`check_lora_optimizer_precision`), before anything is zeroed.
    """
    check_lora_optimizer_precision(model, optimizer)
    count = 0
    for entry in iter_lora_sites(model):
        for _, param in entry.tensors:
            shape, mask = logical_shape(param), zero_mask_of(param)
            zero_padding_(param.data, shape, mask)
            for grad in (param.grad, getattr(param, "main_grad", None)):
                if grad is not None and grad.shape == param.shape:
                    zero_padding_(grad, shape, mask)
            if optimizer is not None:
                zero_optimizer_padding_(optimizer, param, mask)
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
    return finish_slots_param_sync(entry.adapter for entry in iter_lora_sites(model))
