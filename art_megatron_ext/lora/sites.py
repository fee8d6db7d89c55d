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


def zero_lora_padding_(model: torch.nn.Module, optimizer=None) -> int:
    """Zero the padded regions (and structural zeros of stacked fused slots) of every LoRA
    parameter, its `.grad` and `main_grad`.

    With `optimizer`, the same regions of what it keeps for each parameter are zeroed too:
    per-parameter state tensors (Adam moments) of a torch optimizer, and the flat main-param,
    grad and moment shards of Megatron's `DistributedOptimizer`. Call it after backward (before
    the step) and after the step. Returns the number of parameters visited.
    """
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
