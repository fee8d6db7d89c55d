"""Which LoRA slot a forward pass uses: a context manager that survives recomputation.

Why: one model holds several adapters (slots), e.g. the policy being trained and a frozen
reference. The choice is made around a forward pass with `activate_slot(model, name)`, but
Megatron recomputes checkpointed regions during backward, after that `with` block has exited;
a recomputation under a different slot would produce silently wrong gradients. So the active
slot is captured together with the RNG states Megatron saves for recomputation and restored
with them (see `compat.register_recompute_state`).

Rules at a LoRA site, for the innermost active choice:
- a slot name: use that slot; a site that does not hold it adds nothing (a slot may target a
  subset of the model's sites);
- `None` (`activate_slot(model, None)`): base model only, no LoRA;
- no `activate_slot` at all: the slot named `config.DEFAULT_SLOT` when the site has it, and
  an error if the site holds other slots but no default (an ambiguous forward is refused).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from . import active_slot
from .site import LoraSite


def model_slot_names(model: torch.nn.Module) -> set[str]:
    names: set[str] = set()
    for module in model.modules():
        if isinstance(module, LoraSite):
            names.update(module.slots.keys())
    return names


@contextlib.contextmanager
def activate_slot(model: torch.nn.Module, name: str | None) -> Iterator[None]:
    """Run forward passes of `model` with slot `name` (None: base model, no LoRA).

    Raises KeyError naming the model's slots if no site of `model` holds `name`.
    """
    if name is not None:
        known = model_slot_names(model)
        if name not in known:
            raise KeyError(f"no LoRA slot {name!r} in this model; its slots are {sorted(known)}")
    active_slot.install_recompute_capture()
    active_slot.push(name)
    try:
        yield
    finally:
        active_slot.pop()
