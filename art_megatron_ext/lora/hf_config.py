"""What a Hugging Face `config.json` says about the model's maths, read strictly.

Why: a trainer whose model differs from the served one in a detail (a rope scaling ignored, a
bias dropped, tied embeddings trained apart) trains a different policy, and the fresh-token
ratio drifts from 1 without an error anywhere. So every field of the config is either mapped
(it reaches the Megatron model), known not to change the maths (token ids, bookkeeping,
initialisation), or refused by name before anything is built: `UnmappedConfig` lists every
such field at once.

Rope: HF computes the inverse frequencies from `rope_parameters` (transformers >= 5) or
`rope_theta` + `rope_scaling` (older files); `rope_inv_freq` is the same formula for the types
mapped here ("default", "linear", "llama3"), so the trainer uses the checkpoint's own values
(Megatron's built-in llama3 scaling fixes low 1, high 4 and 8192 original positions).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

#: Fields that do not change what the model computes from token ids.
HARMLESS_FIELDS = frozenset(
    {
        "_name_or_path",
        "architectures",
        "model_type",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "use_cache",
        "initializer_range",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "id2label",
        "label2id",
        "problem_type",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "tokenizer_class",
        "max_position_embeddings",
        "attention_dropout",  # training-time dropout; must be 0, checked below
        "output_router_logits",
        "router_aux_loss_coef",
    }
)
#: Fields `GptShape` maps into the Megatron model.
DENSE_FIELDS = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "tie_word_embeddings",
        "attention_bias",
        "mlp_bias",
        "pretraining_tp",
        "use_sliding_window",
        "sliding_window",
        "max_window_layers",
        "layer_types",
    }
)
ROPE_TYPES = ("default", "linear", "llama3")


class UnmappedConfig(ValueError):
    """The HF config has fields (or values) the Megatron mapping does not carry over."""


@dataclass(frozen=True)
class RopeScaling:
    """A mapped rope scaling (HF's `rope_parameters` minus the theta)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def read_config(path: str | Path) -> dict:
    """The parsed `config.json` at `path` (the file or the directory holding it)."""
    path = Path(path)
    return json.loads((path / "config.json" if path.is_dir() else path).read_text())


def rope_of(cfg: dict, problems: list[str]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from either config spelling; unmapped rope types go to `problems`."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
    kind = params.pop("rope_type", params.pop("type", "default"))
    if kind not in ROPE_TYPES:
        problems.append(f"rope type {kind!r} (mapped: {', '.join(ROPE_TYPES)})")
        return float(theta), None
    if params.pop("partial_rotary_factor", 1.0) != 1.0:
        problems.append("partial_rotary_factor != 1")
    if kind == "default":
        return float(theta), None
    keep = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    extra = sorted(set(params) - keep)
    if extra:
        problems.append(f"rope parameters {extra} of type {kind!r}")
    return float(theta), RopeScaling(kind, **{k: v for k, v in params.items() if k in keep})


def check_dense(
    cfg: dict, where: str, extra_fields: frozenset = frozenset()
) -> tuple[float, RopeScaling | None]:
    """Refuse, naming each, every field of a dense Llama/Qwen config that the mapping would
    drop or get wrong; return the rope's (theta, scaling) it read on the way. `extra_fields`
    are mapped by the caller (an MoE shape's)."""
    problems = [
        f"field {k!r}"
        for k in sorted(cfg)
        if k not in HARMLESS_FIELDS | DENSE_FIELDS | extra_fields
    ]
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg['hidden_act']!r} (mapped: 'silu')")
    if cfg.get("mlp_bias"):
        problems.append("mlp_bias")
    if cfg.get("model_type") == "llama" and cfg.get("attention_bias"):
        problems.append("attention_bias (Llama's adds an o_proj bias too)")
    if cfg.get("model_type") == "qwen3" and cfg.get("attention_bias"):
        problems.append("attention_bias")
    if cfg.get("pretraining_tp", 1) != 1:
        problems.append("pretraining_tp != 1")
    if cfg.get("attention_dropout", 0.0):
        problems.append("attention_dropout != 0 (the trainer runs without dropout)")
    # Qwen2/3 slide only with use_sliding_window (or per layer_types); Mistral whenever
    # sliding_window is set
    if (
        cfg.get("use_sliding_window")
        or any(t != "full_attention" for t in cfg.get("layer_types") or ())
        or (cfg.get("model_type") == "mistral" and cfg.get("sliding_window") is not None)
    ):
        problems.append(
            "sliding-window attention (use_sliding_window / layer_types / Mistral's sliding_window)"
        )
    rope = rope_of(cfg, problems)
    if problems:
        raise UnmappedConfig(
            f"{where}: not mapped to Megatron, so the trained model would differ from the "
            f"served one: {'; '.join(problems)}. Nothing was built."
        )
    return rope


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """`[head_dim / 2]` fp32 inverse frequencies, as Hugging Face computes them."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    if scaling.rope_type == "linear":
        return inv / scaling.factor
    old = scaling.original_max_position_embeddings
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """Megatron's padded vocabulary: the next multiple of `divisible_by * tensor_parallel`
    (the rows past `vocab_size` are never sent to the served model)."""
    step = max(1, divisible_by) * tensor_parallel
    return -(-vocab_size // step) * step
