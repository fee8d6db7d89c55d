"""A random Hugging Face Llama checkpoint of a `GptShape`, for tests that load HF weights
into Megatron (or stream them back out). Not collected by pytest."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file


def random_llama_checkpoint(shape, path: Path) -> Path:
    """A random Llama checkpoint of the tiny shape (norm weights away from 1, so they matter)."""
    g = torch.Generator().manual_seed(11)
    h, i, v = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim

    def rand(*size, scale=0.05):
        return torch.randn(*size, generator=g) * scale

    tensors = {
        "model.embed_tokens.weight": rand(v, h, scale=1.0),
        "model.norm.weight": 1 + rand(h, scale=0.2),
        "lm_head.weight": rand(v, h),
    }
    for n in range(shape.num_hidden_layers):
        p = f"model.layers.{n}."
        tensors.update(
            {
                p + "input_layernorm.weight": 1 + rand(h, scale=0.2),
                p + "post_attention_layernorm.weight": 1 + rand(h, scale=0.2),
                p + "self_attn.q_proj.weight": rand(q, h),
                p + "self_attn.k_proj.weight": rand(kv, h),
                p + "self_attn.v_proj.weight": rand(kv, h),
                p + "self_attn.o_proj.weight": rand(h, q),
                p + "mlp.gate_proj.weight": rand(i, h),
                p + "mlp.up_proj.weight": rand(i, h),
                p + "mlp.down_proj.weight": rand(h, i),
            }
        )
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    return path
