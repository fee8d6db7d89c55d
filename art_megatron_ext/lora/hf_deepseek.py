"""The shape of a Hugging Face DeepSeek-V3 model, read strictly from its config; the Megatron
model built from it is `deepseek_gpt.build_deepseek_gpt`.

Why: DeepSeek-V3 (and the models built on its architecture) are the MoE models RL teams serve
at scale, and its maths differs from Llama's in every block: multi-latent attention (MLA: low-rank
q and kv projections with their own RMSNorms, a separate rope part of each head, rope applied
to interleaved pairs), yarn rope with the softmax scale multiplied by `mscale_all_dim`'s
factor, sigmoid routing with a score-correction bias, group-limited expert choice, a routed
scaling factor, one shared expert per MoE layer, and dense first layers. The mapping is our
own (docs/model-mapping.md says why: megatron-bridge 0.6.2 does not build it as shipped, and
the weight renames are few); like the dense mapping, every config field is mapped, known
harmless, or refused by name before anything is built (`UnmappedConfig`).

What Megatron-core 0.19.2 cannot express is refused, each with the reason:
- a group score other than HF's: Megatron scores a group by the sum of its top
  `top_k // topk_group` experts, HF by its top 2 (equal for DeepSeek-V3: 8 // 4);
- `rope_interleave: false`: Megatron's MLA always rotates interleaved pairs;
- a yarn `attention_factor` other than 1 (DeepSeek-V3 has `mscale == mscale_all_dim`, so 1):
  the trainer sets HF's yarn frequencies on a plain rotary embedding (Megatron's own yarn
  embedding allocates on CUDA), and the cos/sin factor would be missing;
- `norm_topk_prob: false` with top-k > 1: Megatron's sigmoid router always renormalises;
- tied embeddings, attention biases, `num_key_value_heads != num_attention_heads`.
The multi-token-prediction layers (`num_nextn_predict_layers`) are not part of the causal LM
HF and vLLM run: not built, their tensors (`model.layers.{num_hidden_layers + k}.*`) not read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from .hf_config import (
    HARMLESS_FIELDS,
    UnmappedConfig,
    read_config,
    rope_inv_freq,
)

#: DeepSeek-V3 fields this mapping carries into the Megatron model.
DEEPSEEK_FIELDS = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "moe_intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",  # HF sets it to qk_rope_head_dim (the rope's width)
        "hidden_act",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "rope_interleave",
        "tie_word_embeddings",
        "attention_bias",
        "pretraining_tp",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "qk_head_dim",
        "v_head_dim",
        "n_routed_experts",
        "n_shared_experts",
        "num_experts_per_tok",
        "n_group",
        "topk_group",
        "norm_topk_prob",
        "routed_scaling_factor",
        "first_k_dense_replace",
        "num_nextn_predict_layers",  # MTP: not part of the causal LM (module docstring)
        "topk_method",  # older DeepSeek configs: "noaux_tc" only, checked below
        "scoring_func",  # older DeepSeek configs: "sigmoid" only, checked below
        "moe_layer_freq",  # older DeepSeek configs: 1 only, checked below
    }
)
_YARN_KEYS = frozenset(
    {
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
    }
)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YarnRope:
    """HF's yarn rope parameters (DeepSeek-V3: factor 40 over 4096 original positions)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True

    @property
    def attention_factor(self) -> float:
        """HF's cos/sin factor (1 when `mscale == mscale_all_dim`, as in DeepSeek-V3)."""
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return _yarn_mscale(self.factor)

    def inv_freq(self, dim: int, theta: float) -> torch.Tensor:
        """`[dim / 2]` fp32 inverse frequencies, HF's yarn formula."""

        def correction_dim(rotations: float) -> float:
            return (
                dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))
            ) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        pos = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        return (1 / (self.factor * pos)) * (1 - extrapolation) + (1 / pos) * extrapolation


def _rope(cfg: dict, problems: list[str]) -> tuple[float, YarnRope | None]:
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0)
    kind = params.pop("rope_type", params.pop("type", "default"))
    if params.pop("partial_rotary_factor", 1.0) != 1.0:
        problems.append("partial_rotary_factor != 1")
    if kind == "default":
        return theta, None
    if kind != "yarn":
        problems.append(f"rope type {kind!r} (mapped for DeepSeek-V3: 'default', 'yarn')")
        return theta, None
    extra = sorted(set(params) - _YARN_KEYS)
    if extra:
        problems.append(f"yarn rope parameters {extra}")
    if params.get("factor") is None:
        params["factor"] = (
            cfg["max_position_embeddings"] / params["original_max_position_embeddings"]
        )
    given_factor = params.pop("attention_factor", None)
    yarn = YarnRope(**{k: v for k, v in params.items() if k in _YARN_KEYS and v is not None})
    factor = yarn.attention_factor if given_factor is None else given_factor
    if abs(factor - 1.0) > 1e-12:
        problems.append(
            f"yarn attention_factor {factor} != 1 (mscale != mscale_all_dim): the trainer's rope "
            "applies no cos/sin factor"
        )
    return theta, yarn


def check_deepseek(cfg: dict, where: str) -> tuple[float, YarnRope | None]:
    """Refuse, naming each, every DeepSeek-V3 config field or value the mapping would drop or
    get wrong (module docstring); return the rope's (theta, yarn) read on the way."""
    problems = [f"field {k!r}" for k in sorted(cfg) if k not in HARMLESS_FIELDS | DEEPSEEK_FIELDS]
    heads = cfg["num_attention_heads"]
    top_k, groups, topk_group = (
        cfg["num_experts_per_tok"],
        cfg.get("n_group") or 1,
        cfg.get("topk_group") or 1,
    )
    checks = [
        (cfg.get("hidden_act", "silu") != "silu", f"hidden_act {cfg.get('hidden_act')!r}"),
        (cfg.get("tie_word_embeddings"), "tie_word_embeddings"),
        (cfg.get("attention_bias"), "attention_bias"),
        (cfg.get("pretraining_tp", 1) != 1, "pretraining_tp != 1"),
        (cfg.get("attention_dropout", 0.0), "attention_dropout != 0"),
        (
            cfg.get("num_key_value_heads", heads) != heads,
            "num_key_value_heads != num_attention_heads (MLA has one key per head)",
        ),
        (
            cfg.get("rope_interleave", True) is not True,
            "rope_interleave false (Megatron's MLA rotates interleaved pairs only)",
        ),
        (
            not cfg.get("norm_topk_prob", True) and top_k > 1,
            "norm_topk_prob false (Megatron's sigmoid router renormalises the top-k)",
        ),
        (
            1 < topk_group < groups and top_k // topk_group != 2,
            f"num_experts_per_tok // topk_group = {top_k // topk_group} (Megatron scores an "
            "expert group by its top num_experts_per_tok // topk_group experts, HF by its top 2)",
        ),
        (
            cfg.get("topk_method", "noaux_tc") != "noaux_tc",
            f"topk_method {cfg.get('topk_method')!r}",
        ),
        (
            cfg.get("scoring_func", "sigmoid") != "sigmoid",
            f"scoring_func {cfg.get('scoring_func')!r}",
        ),
        (cfg.get("moe_layer_freq", 1) != 1, "moe_layer_freq != 1"),
        (not cfg.get("n_routed_experts"), "no routed experts (n_routed_experts)"),
    ]
    problems += [what for bad, what in checks if bad]
    rope = _rope(cfg, problems)
    if problems:
        raise UnmappedConfig(
            f"{where}: not mapped to Megatron, so the trained model would differ from the "
            f"served one: {'; '.join(problems)}. Nothing was built."
        )
    return rope


@dataclass(frozen=True)
class DeepseekShape:
    """The dimensions of a DeepSeek-V3 causal LM (names follow Hugging Face's config)."""

    qk_norm: ClassVar[bool] = False  # MLA's norms are q_a / kv_a layernorms, not per-head

    hidden_size: int
    intermediate_size: int  # dense layers' FFN width
    moe_intermediate_size: int  # each routed expert's FFN width
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    q_lora_rank: int | None  # None: one q_proj (DeepSeek-V2-Lite), no q_a/q_b
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_experts: int
    top_k: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    n_shared_experts: int
    first_k_dense_replace: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    yarn: YarnRope | None = None
    max_position_embeddings: int = 4096

    @classmethod
    def from_hf_config(cls, path: str | Path) -> DeepseekShape:
        """Read a DeepSeek-V3 `config.json` (or the directory holding it); `UnmappedConfig`
        names every field the Megatron model would not carry."""
        cfg = read_config(path)
        if cfg.get("model_type") != "deepseek_v3":
            raise UnmappedConfig(
                f"{path}: model_type {cfg.get('model_type')!r} is not DeepSeek-V3 (deepseek_v3)"
            )
        theta, yarn = check_deepseek(cfg, str(path))
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            moe_intermediate_size=cfg["moe_intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            vocab_size=cfg["vocab_size"],
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"],
            num_experts=cfg["n_routed_experts"],
            top_k=cfg["num_experts_per_tok"],
            n_group=cfg.get("n_group") or 1,
            topk_group=cfg.get("topk_group") or 1,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            n_shared_experts=cfg.get("n_shared_experts") or 0,
            first_k_dense_replace=cfg.get("first_k_dense_replace", 0),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            yarn=yarn,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        )

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(range(min(self.first_k_dense_replace, self.num_hidden_layers)))

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(range(len(self.dense_layers), self.num_hidden_layers))

    def inv_freq(self) -> torch.Tensor:
        """The rope part's inverse frequencies, as HF computes them."""
        if self.yarn is None:
            return rope_inv_freq(self.qk_rope_head_dim, self.rope_theta, None)
        return self.yarn.inv_freq(self.qk_rope_head_dim, self.rope_theta)
