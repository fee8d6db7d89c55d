"""What a commit writes into one LoRA index on this worker, prepared while staging.

`plan` runs on the staging thread, off the step loop: for every LoRA layer of the model it
cuts this rank's shard of the packed adapter on the host and checks that it fits the slot
(`slot_layout`). On a GPU, `to_device` then copies exactly those shards to the device (never
the whole adapter) and counts the bytes it moved. `write` is the commit's part, between two
engine steps: every layer's index gets the staged pieces, vLLM's `set_lora` for a layer the
plugin does not mirror, or a reset for a layer the adapter leaves out (as `activate_adapter`
does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from art_vllm_plugin.compat.worker import lora_modules, module_lora_weights
from art_vllm_plugin.worker import slot_layout
from art_vllm_plugin.worker.slot_piece import LoraUpdateError, Piece


@dataclass
class SlotWrites:
    #: module name -> (kind, this rank's pieces), for layers whose `set_lora` is mirrored.
    shards: dict[str, tuple[str, list[Piece]]] = field(default_factory=dict)
    #: module name -> (A, B) packed as vLLM keeps them, for vLLM's own `set_lora`.
    whole: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    #: Bytes `to_device` moved to the device (0: the tensors are the host's).
    device_bytes: int = 0


def plan(manager, lora_model) -> SlotWrites:
    """This rank's writes of a packed adapter, checked against every slot; raises
    `LoraUpdateError` naming module and tensor when one does not fit."""
    writes = SlotWrites()
    for name, module in lora_modules(manager).items():
        weights = module_lora_weights(manager, lora_model, name)
        if not weights:
            continue
        try:
            laid_out = slot_layout.pieces(module, weights.lora_a, weights.lora_b)
        except LoraUpdateError as exc:  # the layer's own packing check: name the module
            raise LoraUpdateError(f"{name}: {exc}") from None
        if laid_out is None:
            writes.whole[name] = (weights.lora_a, weights.lora_b)
            continue
        slot_layout.check_fits(name, laid_out[1])
        writes.shards[name] = laid_out
    return writes


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def to_device(writes: SlotWrites, move: Callable[[Any], Any]) -> SlotWrites:
    """The same writes with every tensor replaced by `move(tensor)` (its device copy);
    `device_bytes` counts what was moved."""
    moved = 0

    def one(t):
        nonlocal moved
        if t is None:
            return None
        moved += _nbytes(t)
        return move(t)

    def many(x):
        return [one(t) for t in x] if isinstance(x, list) else one(x)

    out = SlotWrites()
    for name, (kind, layer_pieces) in writes.shards.items():
        out.shards[name] = (kind, [p.moved(one(p.tensor)) for p in layer_pieces])
    for name, (a, b) in writes.whole.items():
        out.whole[name] = (many(a), many(b))
    out.device_bytes = moved
    return out


def tensors(writes: SlotWrites) -> list:
    """Every tensor the writes read from (what must outlive the copies that read them)."""
    out = [p.tensor for _, layer_pieces in writes.shards.values() for p in layer_pieces]
    for a, b in writes.whole.values():
        for x in (a, b):
            out.extend(t for t in (x if isinstance(x, list) else [x]) if t is not None)
    return out


def write(manager, index: int, writes: SlotWrites) -> None:
    for name, module in lora_modules(manager).items():
        if name in writes.shards:
            kind, layer_pieces = writes.shards[name]
            slot_layout.write(module, index, kind, layer_pieces)
        elif name in writes.whole:
            module.set_lora(index, *writes.whole[name])
        else:
            module.reset_lora(index)
