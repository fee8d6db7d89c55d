"""The Hugging Face DeepSeek-V3 model as a Megatron-core GPT: its shape, read strictly, and
the model built from it.

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
    padded_vocab_size,
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


def build_deepseek_gpt(
    shape: DeepseekShape,
    *,
    params_dtype: torch.dtype = torch.float32,
    max_sequence_length: int = 256,
    make_vocab_size_divisible_by: int = 1,
    **config_overrides,
):
    """A local-spec (no Transformer Engine) Megatron `GPTModel` with multi-latent attention and
    `shape`'s dense/MoE layer pattern, for this rank's pipeline stage; Megatron's parallel state
    must be set. `config_overrides` go to the `MLATransformerConfig`. At TP > 1 sequence
    parallelism is on (Megatron requires it with MoE) and every norm is sequence-parallel. The
    core attention is `mla_core_attention.SdpaCoreAttention` (Megatron's local one has no
    separate key and value head widths). The vocabulary is padded as Megatron trainers pad it
    (`make_vocab_size_divisible_by` times TP); the loader zero-fills the padded rows and the
    stream never sends them. Experts are Megatron's `SequentialMLP`."""
    import dataclasses

    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from art_megatron_ext.compat import mla_rotary_modules, set_rotary_inv_freq

    from .hf_moe_weights import _sequence_parallel_norms
    from .mla_core_attention import SdpaCoreAttention

    tp = config_overrides.setdefault(
        "tensor_model_parallel_size", parallel_state.get_tensor_model_parallel_world_size()
    )
    config_overrides.setdefault(
        "expert_tensor_parallel_size", parallel_state.get_expert_tensor_parallel_world_size()
    )
    config_overrides.setdefault("sequence_parallel", tp > 1)
    yarn = shape.yarn
    grouped = 1 < shape.topk_group < shape.n_group
    config = MLATransformerConfig(
        num_layers=shape.num_hidden_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.intermediate_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_attention_heads,
        q_lora_rank=shape.q_lora_rank,
        kv_lora_rank=shape.kv_lora_rank,
        qk_head_dim=shape.qk_nope_head_dim,
        qk_pos_emb_head_dim=shape.qk_rope_head_dim,
        v_head_dim=shape.v_head_dim,
        # a plain rotary embedding given HF's (yarn) frequencies below; the yarn factor and
        # mscale_all_dim still set the softmax scale, as HF's
        rope_type="rope",
        rotary_base=shape.rope_theta,
        rotary_scaling_factor=yarn.factor if yarn else 1.0,
        mscale=yarn.mscale if yarn else 1.0,
        mscale_all_dim=yarn.mscale_all_dim if yarn else 0.0,
        qk_layernorm=True,  # the local spec builds q_a / kv_a layernorms only with it
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        num_moe_experts=shape.num_experts,
        moe_layer_freq=[
            0 if i in shape.dense_layers else 1 for i in range(shape.num_hidden_layers)
        ],
        moe_ffn_hidden_size=shape.moe_intermediate_size,
        moe_shared_expert_intermediate_size=(
            shape.moe_intermediate_size * shape.n_shared_experts or None
        ),
        moe_router_topk=shape.top_k,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=shape.routed_scaling_factor,
        moe_router_num_groups=shape.n_group if grouped else None,
        moe_router_group_topk=shape.topk_group if grouped else None,
        moe_router_dtype="fp32",
        moe_aux_loss_coeff=0.0,
        moe_router_load_balancing_type="none",
        moe_token_dispatcher_type="alltoall",
        **config_overrides,
    )
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    layers = []
    for layer in spec.layer_specs:
        attn = layer.submodules.self_attention
        attn = dataclasses.replace(
            attn, submodules=dataclasses.replace(attn.submodules, core_attention=SdpaCoreAttention)
        )
        sub = dataclasses.replace(layer.submodules, self_attention=attn)
        layers.append(dataclasses.replace(layer, submodules=sub))
    spec = dataclasses.replace(spec, layer_specs=layers)
    if config.sequence_parallel:
        spec = _sequence_parallel_norms(spec)
    model = GPTModel(
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(shape.vocab_size, make_vocab_size_divisible_by, tp),
        max_sequence_length=max_sequence_length,
        position_embedding_type="rope",
        rotary_base=int(shape.rope_theta),
        share_embeddings_and_output_weights=False,
    )
    inv_freq = shape.inv_freq()
    for rotary in mla_rotary_modules(model):
        set_rotary_inv_freq(rotary, inv_freq)
    return model
