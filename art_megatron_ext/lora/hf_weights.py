"""Load a Hugging Face Llama checkpoint into the Megatron GPT of `tiny_gpt` (any TP size).

Why: LoRA trained on the Megatron side is only meaningful for the serving side's model if the
base weights are the same. Q/K/V are fused in Megatron's per-group interleaved layout and
gate/up in its per-rank [gate; up] layout (the same code as the LoRA B layout, `hf_layout`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .hf_layout import FUSED_GATE_UP, fuse_b_shard, fused_qkv


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = model_dir / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(model_dir / name)))
    return tensors


def megatron_state_from_hf(
    hf: dict[str, torch.Tensor],
    shape,
    tp_rank: int = 0,
    tp_size: int = 1,
    *,
    te_layernorm: bool = False,
) -> dict[str, torch.Tensor]:
    """Megatron GPT state-dict entries (this TP rank's shards) from HF Llama tensors.

    `te_layernorm`: the layer norms live in the layernorm-fused linears of a Transformer Engine
    spec (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`) instead of
    `input_layernorm` / `pre_mlp_layernorm`."""
    qkv = fused_qkv(shape)
    fc1 = FUSED_GATE_UP

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp_size, dim=0)[tp_rank]

    def cols(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp_size, dim=1)[tp_rank]

    out = {
        "embedding.word_embeddings.weight": rows(hf["model.embed_tokens.weight"]),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
        "output_layer.weight": rows(hf["lm_head.weight"]),
    }
    for i in range(shape.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn_norm, mlp_norm = (
            ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight")
            if te_layernorm
            else ("input_layernorm.weight", "pre_mlp_layernorm.weight")
        )
        out[m + attn_norm] = hf[h + "input_layernorm.weight"]
        out[m + mlp_norm] = hf[h + "post_attention_layernorm.weight"]
        q, k, v = (hf[h + f"self_attn.{p}_proj.weight"] for p in "qkv")
        out[m + "self_attention.linear_qkv.weight"] = fuse_b_shard(qkv, [q, k, v], tp_rank, tp_size)
        out[m + "self_attention.linear_proj.weight"] = cols(hf[h + "self_attn.o_proj.weight"])
        gate, up = hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]
        out[m + "mlp.linear_fc1.weight"] = fuse_b_shard(fc1, [gate, up], tp_rank, tp_size)
        out[m + "mlp.linear_fc2.weight"] = cols(hf[h + "mlp.down_proj.weight"])
    return out


def load_hf_weights(model: torch.nn.Module, model_dir: str | Path, shape) -> None:
    """Copy the HF checkpoint's weights into `model` (before or after `attach_lora`)."""
    from megatron.core import parallel_state

    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    hf = _read_safetensors(Path(model_dir))
    if "lm_head.weight" not in hf:  # tied embeddings
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    params = dict(model.named_parameters())
    te_layernorm = any(name.endswith("linear_qkv.layer_norm_weight") for name in params)
    state = megatron_state_from_hf(hf, shape, tp_rank, tp_size, te_layernorm=te_layernorm)
    missing = sorted(set(state) - set(params))
    if missing:
        raise KeyError(f"{model_dir}: Megatron model has no parameter {missing[0]}")
    with torch.no_grad():
        for name, value in state.items():
            target = params[name]
            if target.shape != value.shape:
                raise ValueError(
                    f"{model_dir}: {name} is {tuple(value.shape)} from HF, "
                    f"{tuple(target.shape)} in the Megatron model"
                )
            target.copy_(value.to(target.dtype))
