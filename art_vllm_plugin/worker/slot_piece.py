"""One tensor of an adapter as vLLM's `set_lora` writes it, and the error a misfit raises.

A `Piece` is what the commit copies into one stacked tensor of one LoRA layer: stacked index
`index` of its `buffer` takes the piece in its leading corner, `buffer[index, 0, :rows, :cols]`
for a linear layer (a 2-D piece) and `buffer[index, :, :rows, :cols]` for an expert layer (a
3-D piece, one row per expert). A rank below the slot's leaves the rest of the slot zero, as
`set_lora` does after its reset.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


class LoraUpdateError(ValueError):
    """The adapter does not fit the slot; the message names module and tensor."""


@dataclass(frozen=True)
class Piece:
    """One tensor as vLLM's `set_lora` writes it into one stacked tensor."""

    label: str  # names the tensor in messages: "slice 1 lora_B", "gate_proj (w1) lora_A"
    tensor: Any  # this rank's shard: a host view, or its device copy once staged
    buffer: Any  # the layer's stacked tensor, [max_loras, ...]
    is_a: bool  # lora_A (rank, in) or lora_B (out, rank) in its last two dims
    experts: bool = False  # an expert layer's: one row per expert, `buffer[index]` whole

    def moved(self, tensor) -> Piece:
        return replace(self, tensor=tensor)

    def slot(self, index: int):
        """The whole slot this piece writes into at stacked index `index`."""
        return self.buffer[index] if self.experts else self.buffer[index, 0]

    def target(self, index: int):
        """The part of the slot the piece covers."""
        rows, cols = self.tensor.shape[-2:]
        return self.slot(index)[..., :rows, :cols]
