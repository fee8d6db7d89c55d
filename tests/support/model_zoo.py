"""The model zoo: tiny random Hugging Face checkpoints with the features real checkpoints have.

Why: a trainer-side mapping that only ever saw one tiny Llama drops what real models carry
(Llama-3.1's rope scaling, Qwen2's q/k/v biases, tied embeddings, Qwen3's q/k norms and a
head size that is not hidden / heads, vocabularies that are not a multiple of the tensor
parallel size). Each entry here is the smallest checkpoint that has its family's features, made
by Hugging Face transformers itself from a seed (so the reference is HF's own model code), saved
in bf16 safetensors like the published checkpoints. Norms are moved away from 1 and biases
away from 0 (HF initialises them to exactly that), so a dropped or swapped one changes logits.

The vocabulary (1030 rows) is a multiple of neither 4 nor 128: Megatron pads it
(`make_vocab_size_divisible_by`), and the padding must never reach the served model. Every
head is 32 wide: vLLM's CPU attention runs head sizes 32, 64, 80 and up only (16 starts, then
fails the first request: "Unsupported CPU attention configuration: head_dim=16"), and the zoo
is served too (tests/cross_env/test_model_zoo_serving.py).

Both environments use it (transformers is in the `dev` extra). Not collected by pytest.
"""

from __future__ import annotations

import json
from pathlib import Path

ZOO_VOCAB = 1030
_COMMON = dict(
    vocab_size=ZOO_VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.08,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    # Llama-3.1 says 8192; a tiny model's prompts are short, so the scaled band is moved down
    # to where they reach (wavelengths above 64 / low_freq_factor positions).
    original_max_position_embeddings=64,
    rope_theta=500000.0,
)

# name -> (transformers config class, its arguments); every entry's features in its name's
# docstring line below.
ZOO: dict[str, tuple[str, dict]] = {
    # Llama-3.1: rope llama3 scaling, untied, GQA
    "llama3.1": ("LlamaConfig", dict(_COMMON, head_dim=32, rope_parameters=LLAMA3_ROPE)),
    # Llama-3.2 (1B/3B): the same plus tied embeddings
    "llama3.2": (
        "LlamaConfig",
        dict(_COMMON, head_dim=32, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True),
    ),
    # Qwen2.5: q/k/v biases (no o_proj bias), tied embeddings, rope theta 1e6
    "qwen2.5": (
        "Qwen2Config",
        dict(
            _COMMON,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0),
        ),
    ),
    # Qwen3: per-head q/k RMSNorm, head_dim (32) != hidden / heads (16), untied
    "qwen3": (
        "Qwen3Config",
        dict(
            _COMMON,
            hidden_size=64,
            intermediate_size=128,
            head_dim=32,
            rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0),
        ),
    ),
    # Qwen3-MoE: q/k norm, 8 experts top-2 renormalised, a dense first layer
    "qwen3-moe": (
        "Qwen3MoeConfig",
        dict(
            _COMMON,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
        ),
    ),
    # DeepSeek-V3: MLA (q and kv low-rank), yarn rope with DeepSeek-V3's own values (factor
    # 40, mscale = mscale_all_dim = 1: the softmax scale grows, cos/sin do not) over 64
    # original positions (so the prompts reach the interpolated band), shared expert, grouped
    # sigmoid routing with a score-correction bias and a routed scaling factor (16 experts in
    # 4 groups, 2 groups chosen, top 4: 4 // 2 experts score a group, as DeepSeek-V3's
    # 8 // 4), a dense first layer
    "deepseek-v3": (
        "DeepseekV3Config",
        dict(
            _COMMON,
            num_key_value_heads=4,
            max_position_embeddings=64 * 40,  # yarn's factor times its original positions
            moe_intermediate_size=32,
            n_routed_experts=16,
            n_shared_experts=1,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            # in the published config.json (HF's class has no such fields and ignores them;
            # vLLM builds the score-correction bias only for "noaux_tc")
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            first_k_dense_replace=1,
            q_lora_rank=32,
            # DeepSeek-V3's latent (512) and rope (64) widths: vLLM's CPU MLA kernels run
            # only a 576-wide latent cache
            kv_lora_rank=512,
            qk_nope_head_dim=32,
            qk_rope_head_dim=64,
            v_head_dim=32,
            head_dim=64,
            rope_interleave=True,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=40.0,
                original_max_position_embeddings=64,
                beta_fast=32,
                beta_slow=1,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),
        ),
    ),
}
DENSE = ("llama3.1", "llama3.2", "qwen2.5", "qwen3")


def write_checkpoint(name: str, out: Path, *, seed: int = 0) -> Path:
    """Write zoo model `name` to `out` (config.json + model.safetensors, bf16); returns `out`.

    Deterministic for one transformers version: the same seed gives the same bytes."""
    import torch
    import transformers

    cls_name, kwargs = ZOO[name]
    config = getattr(transformers, cls_name)(**kwargs, dtype="bfloat16")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname:
                base = 1.0 if "norm" in pname and not pname.endswith("bias") else 0.0
                param.copy_(base + 0.2 * torch.randn(param.shape, generator=g))
            elif "e_score_correction_bias" in pname:
                param.copy_(0.1 * torch.randn(param.shape, generator=g))
        for bname, buf in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=g))
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return out


def checkpoint(name: str, root: Path) -> Path:
    """Zoo model `name` under `root/name`, written on first use."""
    out = root / name
    if not (out / "config.json").exists():
        write_checkpoint(name, out)
    return out


def hf_config(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())
