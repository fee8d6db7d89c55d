"""Where an adapter's expert weights land in vLLM's expert LoRA layer (`FusedMoEWithLoRA`).

Why a module of its own: the expert layer keeps its slots in other tensors than the linear
layers, and `set_lora` there takes other inputs. The adapter's experts are packed by vLLM
(`_create_merged_loras_inplace`, `pack_moe`) into one tensor per projection, one row per
expert:

- 2-D layer (`FusedMoEWithLoRA`, e.g. Qwen3-MoE): A = [gate (w1), down (w2), up (w3)], each
  `(experts, rank, in)`, B likewise `(experts, out, rank)`. gate and up go into the two w13
  slots (a non-gated layer has one: up is not written), down into the w2 slot. Each factor is
  first matched to its buffer's expert dimension (a shared factor keeps one row), as
  `set_lora` does.
- 3-D layer (`FusedMoE3DWithLoRA`): A = [gate_up (w13), down (w2)], B likewise.

Then each factor is cut to this rank's tensor-parallel shard by the layer's own slicing
(`_slice_w13_a`, `_slice_w13_b`, `_slice_w2_a`, `_slice_w2_b`). `vllm.lora.layers.fused_moe`
in vLLM 0.32 is the reference for all of it.
"""

from __future__ import annotations

from art_vllm_plugin.compat.worker import moe_lora_buffers, moe_match_expert_dim, moe_rank_shard
from art_vllm_plugin.worker.slot_piece import LoraUpdateError, Piece


def _factors(kind: str, lora_a, lora_b, count: int) -> tuple[list, list]:
    if not (isinstance(lora_a, list) and isinstance(lora_b, list)):
        raise LoraUpdateError(
            f"expert weights are not packed per projection (got {type(lora_a).__name__}); "
            "a fused 3-D expert adapter needs the slot's is_3d_lora_weight"
        )
    if len(lora_a) != count or len(lora_b) != count:
        raise LoraUpdateError(
            f"expert weights packed as {len(lora_a)} projections, the {kind} layer takes {count}"
        )
    return lora_a, lora_b


def _shared(module, factor, buffer):
    """A factor stored once for all experts (buffer expert dim 1) keeps one row, as
    `set_lora` does; any other count is left for the fit check to name."""
    if buffer.shape[1] == 1 and factor.dim() == 3:
        return moe_match_expert_dim(module, factor, buffer)
    return factor


def pieces(module, kind: str, lora_a, lora_b) -> list[Piece]:
    """This rank's pieces of one expert layer: one per tensor `set_lora` copies."""
    w13_a, w13_b, w2_a, w2_b = moe_lora_buffers(module)
    if kind == "moe":
        (gate_a, down_a, up_a), (gate_b, down_b, up_b) = _factors(kind, lora_a, lora_b, 3)
        projections = [("gate_proj (w1)", gate_a, gate_b, w13_a[0], w13_b[0], "w13")]
        if len(w13_a) == 2:  # gated: up_proj has slots of its own
            projections.append(("up_proj (w3)", up_a, up_b, w13_a[1], w13_b[1], "w13"))
        projections.append(("down_proj (w2)", down_a, down_b, w2_a[0], w2_b[0], "w2"))
        projections = [
            (label, _shared(module, a, a_buf), _shared(module, b, b_buf), a_buf, b_buf, which)
            for label, a, b, a_buf, b_buf, which in projections
        ]
    else:
        (w13a, w2a), (w13b, w2b) = _factors(kind, lora_a, lora_b, 2)
        projections = [
            ("gate_up_proj (w13)", w13a, w13b, w13_a[0], w13_b[0], "w13"),
            ("down_proj (w2)", w2a, w2b, w2_a[0], w2_b[0], "w2"),
        ]
    out = []
    for label, a, b, a_buf, b_buf, which in projections:
        a = moe_rank_shard(module, f"{which}_a", a)
        b = moe_rank_shard(module, f"{which}_b", b)
        out.append(Piece(f"{label} lora_A", a, a_buf, True, experts=True))
        out.append(Piece(f"{label} lora_B", b, b_buf, False, experts=True))
    return out
