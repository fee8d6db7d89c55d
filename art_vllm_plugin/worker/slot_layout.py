"""Where each tensor of an adapter lands in one LoRA layer's stacked tensors, on this worker.

Why the plugin writes the stacked tensors itself instead of calling vLLM's `set_lora`:
`set_lora` takes the whole adapter and slices this rank's tensor-parallel shard on the device,
so every rank would copy the whole adapter to its device first. Staging instead cuts the shard
on the host with the layer's own slicing methods (`slice_lora_a/b`, `expand_packed_lora`, the
expert layers' `_slice_w13_a/...`), and the commit copies exactly what `set_lora` would have
copied, where it would have copied it. That is only done for the layers whose `set_lora` this
module mirrors (`compat.set_lora_kind`: the linear layers, merged/QKV, and the expert layers);
any other layer (embeddings, logits, a subclass with its own `set_lora`) is written by vLLM's
`set_lora` with the whole adapter, as before.

Each tensor as written is a `Piece` (`worker/slot_piece.py`); the expert layers' pieces come
from `worker/moe_slot_layout.py`.
"""

from __future__ import annotations

from art_vllm_plugin.compat.worker import (
    linear_lora_buffers,
    moe_enable_index,
    set_lora_kind,
)
from art_vllm_plugin.worker import moe_slot_layout
from art_vllm_plugin.worker.slot_piece import LoraUpdateError, Piece

MOE_KINDS = ("moe", "moe3d")
__all__ = ["MOE_KINDS", "LoraUpdateError", "Piece", "check_fits", "pieces", "write"]


def _as_list(x) -> list:
    return x if isinstance(x, list) else [x]


def _linear_pieces(module, kind: str, lora_a, lora_b) -> list[Piece]:
    """`set_lora` of a linear layer: packed groups expanded to the layer's slices ("merged"),
    then this rank's shard (`slice_lora_a/b`), each slice into `[index, 0]` of its tensors."""
    if kind == "merged" and isinstance(lora_b, list) and len(lora_b) != module.n_slices:
        lora_a, lora_b = module.expand_packed_lora(lora_a, lora_b)
    if module.tp_size > 1:
        lora_a, lora_b = module.slice_lora_a(lora_a), module.slice_lora_b(lora_b)
    a_slots, b_slots = linear_lora_buffers(module)
    out = []
    for i, (a, b) in enumerate(zip(_as_list(lora_a), _as_list(lora_b), strict=False)):
        if a is not None:
            out.append(Piece(f"slice {i} lora_A", a, a_slots[i], True))
        if b is not None:
            out.append(Piece(f"slice {i} lora_B", b, b_slots[i], False))
    return out


def pieces(module, lora_a, lora_b) -> tuple[str, list[Piece]] | None:
    """(kind, this rank's pieces) of one layer's packed A/B; None for a layer whose
    `set_lora` is not mirrored here (vLLM's `set_lora` writes it)."""
    kind = set_lora_kind(module)
    if kind in ("linear", "merged"):
        return kind, _linear_pieces(module, kind, lora_a, lora_b)
    if kind in MOE_KINDS:
        return kind, moe_slot_layout.pieces(module, kind, lora_a, lora_b)
    return None


def check_fits(module_name: str, layer_pieces: list[Piece]) -> None:
    """Every piece fits its slot as `set_lora` would write it: same leading dims (experts),
    rank at most the slot's, features equal, dtype equal. Raises `LoraUpdateError` naming the
    module and tensor."""
    for p in layer_pieces:
        shape, slot = tuple(p.tensor.shape), tuple(p.slot(0).shape)
        name = "lora_A" if p.is_a else "lora_B"
        rank_dim, feature_dim = (-2, -1) if p.is_a else (-1, -2)
        feature = "in_features" if p.is_a else "out_features"
        experts = f"experts {slot[0]}, " if len(slot) == 3 else ""
        if (
            len(shape) != len(slot)
            or shape[:-2] != slot[:-2]
            or shape[rank_dim] > slot[rank_dim]
            or shape[feature_dim] != slot[feature_dim]
        ):
            raise LoraUpdateError(
                f"{module_name} {p.label}: {name} shape {shape} does not fit the slot "
                f"({experts}rank <= {slot[rank_dim]}, {feature} {slot[feature_dim]})"
            )
        if p.tensor.dtype != p.buffer.dtype:
            raise LoraUpdateError(
                f"{module_name} {p.label}: {name} dtype {p.tensor.dtype} differs from the "
                f"slot's {p.buffer.dtype}"
            )


def write(module, index: int, kind: str, layer_pieces: list[Piece]) -> None:
    """What `set_lora(index, ...)` does once its input is sliced: clear the index, (expert
    layers) flag it as holding an adapter, copy each piece into its corner."""
    module.reset_lora(index)
    if kind in MOE_KINDS:
        moe_enable_index(module, index)
    for p in layer_pieces:
        p.target(index).copy_(p.tensor, non_blocking=True)
