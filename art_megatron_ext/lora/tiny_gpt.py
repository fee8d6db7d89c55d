"""A Megatron-core GPT with the shape of a Hugging Face Llama/Qwen config.

Why: the trainer's model must be the served one, or LoRA and full weights trained here mean
something else in vLLM. The shape is read from the HF `config.json` (which the serving side
serves), not restated here, and read strictly (`hf_config`): Llama-3.x rope scaling, Qwen2's
q/k/v biases, Qwen3's q/k norms, tied embeddings and a head size other than hidden / heads
are mapped; any other field that changes the maths is refused by name.

The vocabulary may be padded (`make_vocab_size_divisible_by`, as Megatron's trainers do, and
always to a multiple of the tensor-parallel size); the padded rows are zero, never trained
into a served token (logprobs mask them) and never exported.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .hf_config import (
    RopeScaling,
    UnmappedConfig,
    check_dense,
    padded_vocab_size,
    read_config,
    rope_inv_freq,
)

DENSE_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass(frozen=True)
class GptShape:
    """The dimensions a Llama-style GPT needs (names follow Hugging Face's config)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False  # Qwen2: q/k/v projections have biases (o_proj has none)
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of queries and keys
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf_config(cls, path: str | Path) -> GptShape:
        """Read a HF `config.json` (or the directory holding it); `UnmappedConfig` names every
        field the Megatron model would not carry."""
        cfg = read_config(path)
        kind = cfg.get("model_type")
        if kind not in DENSE_MODEL_TYPES:
            raise UnmappedConfig(
                f"{path}: model_type {kind!r} is not a dense Llama/Qwen model "
                f"(mapped: {', '.join(DENSE_MODEL_TYPES)}; qwen3_moe: lora.hf_moe_weights; "
                "deepseek_v3: lora.hf_deepseek)"
            )
        theta, scaling = check_dense(cfg, str(path))
        heads = cfg["num_attention_heads"]
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=kind == "qwen2",
            qk_norm=kind == "qwen3",
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )

    def inv_freq(self) -> torch.Tensor:
        """The rope inverse frequencies HF computes for this model (`hf_config.rope_inv_freq`)."""
        return rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling)


def local_cpu_settings(params_dtype: torch.dtype) -> dict:
    """`TransformerConfig` settings every model built here shares: initialised on the CPU,
    the local spec's unfused paths (Apex/TE fusions off: CPU-safe, and exact against HF), no
    dropout (the served model has none)."""
    return dict(
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
    )


def gated_rmsnorm_settings(eps: float) -> dict:
    """Llama-style blocks: SiLU-gated MLPs, RMSNorm with the checkpoint's epsilon, no biases."""
    import torch.nn.functional as F

    return dict(
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=eps,
        add_bias_linear=False,
    )


def moe_layer_settings(shape) -> dict:
    """An MoE shape's experts and which layers are dense (`dense_layers`)."""
    return dict(
        num_moe_experts=shape.num_experts,
        moe_layer_freq=[
            0 if i in shape.dense_layers else 1 for i in range(shape.num_hidden_layers)
        ],
        moe_ffn_hidden_size=shape.moe_intermediate_size,
    )


def moe_router_settings() -> dict:
    """Routing as the served model routes: in fp32, no auxiliary loss or balancing term in
    the forward, all-to-all dispatch (runs on gloo)."""
    return dict(
        moe_router_dtype="fp32",
        moe_aux_loss_coeff=0.0,
        moe_router_load_balancing_type="none",
        moe_token_dispatcher_type="alltoall",
    )


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """RMSNorm that accepts Megatron's sequence-parallel config (torch's wrapped norm refuses
    it without Apex/TE). Normalization is per token, so sequence shards need nothing more
    than the `sequence_parallel` mark on the weight (its gradient is then summed over TP)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_: object) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel


def _layer_spec(
    sequence_parallel: bool, num_layers: int, num_experts: int | None, qk_norm: bool = False
):
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec = get_gpt_layer_local_spec(
        num_experts=num_experts, normalization="RMSNorm", qk_layernorm=qk_norm
    )
    if not sequence_parallel:
        return spec
    submodules = dataclasses.replace(
        spec.submodules,
        input_layernorm=SequenceParallelRMSNorm,
        pre_mlp_layernorm=SequenceParallelRMSNorm,
    )
    layer = dataclasses.replace(spec, submodules=submodules)
    return TransformerBlockSubmodules(
        layer_specs=[layer] * num_layers, layer_norm=SequenceParallelRMSNorm
    )


def build_gpt(
    shape: GptShape,
    *,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    recompute: bool = False,
    params_dtype: torch.dtype = torch.float32,
    max_sequence_length: int = 256,
    num_experts: int | None = None,
    expert_parallel: int = 1,
    pipeline_parallel: int = 1,
    layer_spec=None,
    moe_grouped_gemm: bool = False,
    make_vocab_size_divisible_by: int = 1,
):
    """A local-spec (no Transformer Engine) `GPTModel` on CPU; parallel state must be set.

    With `num_experts`, every MLP is a top-2 MoE of `SequentialMLP` experts (FFN width
    `intermediate_size`), split over `expert_parallel` ranks. With `pipeline_parallel` > 1
    this rank builds its stage (layers split evenly; embedding first, output layer last).
    `layer_spec` replaces the local layer spec (e.g. a Transformer Engine spec, built from the
    TE stand-in in tests); `moe_grouped_gemm` sets the config flag grouped expert specs use.
    The vocabulary is padded to a multiple of `make_vocab_size_divisible_by * tensor_parallel`
    (`padded_vocab_size`); rope uses the checkpoint's own inverse frequencies.
    """
    from megatron.core import parallel_state

    moe = {}
    if num_experts:
        moe = dict(
            num_moe_experts=num_experts,
            moe_ffn_hidden_size=shape.intermediate_size,
            moe_router_topk=2,
            **moe_router_settings(),
            expert_model_parallel_size=expert_parallel,
            moe_grouped_gemm=moe_grouped_gemm,
        )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=shape.num_hidden_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.intermediate_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_key_value_heads,
        kv_channels=shape.head_dim,
        **gated_rmsnorm_settings(shape.rms_norm_eps),
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        sequence_parallel=sequence_parallel,
        **local_cpu_settings(params_dtype),
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
        **moe,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec
        or _layer_spec(sequence_parallel, shape.num_hidden_layers, num_experts, shape.qk_norm),
        vocab_size=padded_vocab_size(
            shape.vocab_size, make_vocab_size_divisible_by, tensor_parallel
        ),
        max_sequence_length=max_sequence_length,
        position_embedding_type="rope",
        rotary_base=int(shape.rope_theta),
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    set_rope_inv_freq(model, shape.inv_freq())
    return model


def set_rope_inv_freq(model: torch.nn.Module, inv_freq: torch.Tensor) -> None:
    """Give `model`'s rotary embedding the checkpoint's inverse frequencies."""
    from art_megatron_ext.compat import gpt_rotary_module_attr, set_rotary_inv_freq

    rotary = getattr(model, gpt_rotary_module_attr(), None)
    if rotary is None:
        raise ValueError(f"{type(model).__name__} has no rotary embedding to set")
    set_rotary_inv_freq(rotary, inv_freq)
