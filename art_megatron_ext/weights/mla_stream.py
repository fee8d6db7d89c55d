"""A multi-latent attention (MLA) layer's tensors in Hugging Face DeepSeek-V3 names.

Why: `hf_stream.stream_hf_weights` sends every layer's attention in the served model's names;
MLA has its own seven tensors (the inverse of `lora.hf_deepseek_weights.mla_attention_state`).
The column-parallel projections are made whole over tensor parallel by their output rows, the
output projection by its columns. The local spec shards the q and kv down projections too;
a Transformer Engine spec keeps them whole on every rank (`TELinear`, "duplicated") and fuses
the q_a / kv_a norms into the up projections (`layer_norm_weight`): both are read here, told
apart by the shard's row count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch


def mla_tensors(
    params: dict[str, torch.Tensor],
    m: str,
    h: str,
    shape,
    gather: Callable[[torch.Tensor, int], torch.Tensor],
    tp_size: int,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Layer prefix `m`'s MLA tensors as (HF name under prefix `h`, whole tensor), in the
    checkpoint's order. `gather(shard, dim)` concatenates every TP rank's shard along `dim`
    (a collective: called the same way on every rank)."""
    o, a = m + "self_attention.", h + "self_attn."

    def down(name: str, full_rows: int) -> torch.Tensor:
        local = params[o + name]
        if tp_size > 1 and local.shape[0] * tp_size == full_rows:
            return gather(local, 0)
        if local.shape[0] != full_rows:
            raise ValueError(
                f"stream_hf_weights: {o}{name} has {local.shape[0]} rows of {full_rows}"
            )
        return local.detach().clone()

    def norm(plain: str, fused: str) -> torch.Tensor:
        return params.get(o + fused, params.get(o + plain)).detach().clone()

    if shape.q_lora_rank is None:
        yield a + "q_proj.weight", gather(params[o + "linear_q_proj.weight"], 0)
    else:
        yield a + "q_a_proj.weight", down("linear_q_down_proj.weight", shape.q_lora_rank)
        yield (
            a + "q_a_layernorm.weight",
            norm("q_layernorm.weight", "linear_q_up_proj.layer_norm_weight"),
        )
        yield a + "q_b_proj.weight", gather(params[o + "linear_q_up_proj.weight"], 0)
    yield (
        a + "kv_a_proj_with_mqa.weight",
        down("linear_kv_down_proj.weight", shape.kv_lora_rank + shape.qk_rope_head_dim),
    )
    yield (
        a + "kv_a_layernorm.weight",
        norm("kv_layernorm.weight", "linear_kv_up_proj.layer_norm_weight"),
    )
    yield a + "kv_b_proj.weight", gather(params[o + "linear_kv_up_proj.weight"], 0)
    yield a + "o_proj.weight", gather(params[o + "linear_proj.weight"], 1)
