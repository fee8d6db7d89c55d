"""A random Hugging Face Qwen3-MoE checkpoint (config.json + safetensors in HF's per-expert
layout), for tests that load it into Megatron or stream it back out. Not collected by pytest.

The dtype is a parameter: the loader's tests use bf16 (what a served checkpoint holds), the
weight stream's float32, so a checkpoint round-trips bit for bit through a float32 model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

MOE_CFG = dict(
    model_type="qwen3_moe",
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=64,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[0],
    rms_norm_eps=1e-6,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    tie_word_embeddings=False,
)


def random_qwen3_moe_checkpoint(
    path: Path, *, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides
) -> dict[str, torch.Tensor]:
    """Write a random Qwen3-MoE checkpoint of `MOE_CFG` (`overrides` win) to `path`; return
    its tensors. Norm weights sit away from 1, so a dropped or swapped norm shows."""
    cfg = {**MOE_CFG, **overrides}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(seed)
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def r(*shape):
        return (torch.randn(shape, generator=g) * 0.2).to(dtype)

    t = {
        "model.embed_tokens.weight": r(cfg["vocab_size"], h),
        "model.norm.weight": 1 + r(h),
        "lm_head.weight": r(cfg["vocab_size"], h),
    }
    only = set(cfg["mlp_only_layers"])
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {
            p + "input_layernorm.weight": 1 + r(h),
            p + "post_attention_layernorm.weight": 1 + r(h),
            p + "self_attn.q_proj.weight": r(heads * hd, h),
            p + "self_attn.k_proj.weight": r(kv * hd, h),
            p + "self_attn.v_proj.weight": r(kv * hd, h),
            p + "self_attn.o_proj.weight": r(h, heads * hd),
            p + "self_attn.q_norm.weight": 1 + r(hd),
            p + "self_attn.k_norm.weight": 1 + r(hd),
        }
        if i in only or (i + 1) % cfg["decoder_sparse_step"]:
            f = cfg["intermediate_size"]
            t |= {
                p + "mlp.gate_proj.weight": r(f, h),
                p + "mlp.up_proj.weight": r(f, h),
                p + "mlp.down_proj.weight": r(h, f),
            }
            continue
        f = cfg["moe_intermediate_size"]
        t[p + "mlp.gate.weight"] = r(cfg["num_experts"], h)
        for e in range(cfg["num_experts"]):
            x = f"{p}mlp.experts.{e}."
            t |= {
                x + "gate_proj.weight": r(f, h),
                x + "up_proj.weight": r(f, h),
                x + "down_proj.weight": r(h, f),
            }
    save_file(t, str(path / "model.safetensors"))
    return t
