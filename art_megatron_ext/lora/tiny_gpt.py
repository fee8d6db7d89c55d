"""A Megatron-core GPT with the shape of a Hugging Face Llama config (the tiny model).

Why: the cross-environment check trains LoRA on the Megatron side and serves it on the vLLM
side; both must agree on every module shape. The shape is read from the HF `config.json`
(which the serving side wrote), not restated here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch


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

    @classmethod
    def from_hf_config(cls, path: str | Path) -> GptShape:
        """Read a HF `config.json` (or the directory holding it)."""
        path = Path(path)
        cfg = json.loads((path / "config.json" if path.is_dir() else path).read_text())
        if cfg.get("model_type") not in (None, "llama", "qwen2", "mistral"):
            raise ValueError(f"{path}: model_type {cfg.get('model_type')!r} is not Llama-like")
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
            rope_theta=cfg.get("rope_theta")
            or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0),
        )


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """RMSNorm that accepts Megatron's sequence-parallel config (torch's wrapped norm refuses
    it without Apex/TE). Normalization is per token, so sequence shards need nothing more
    than the `sequence_parallel` mark on the weight (its gradient is then summed over TP)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_: object) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel


def _layer_spec(sequence_parallel: bool, num_layers: int, num_experts: int | None):
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec = get_gpt_layer_local_spec(num_experts=num_experts, normalization="RMSNorm")
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
):
    """A local-spec (no Transformer Engine) `GPTModel` on CPU; parallel state must be set.

    With `num_experts`, every MLP is a top-2 MoE of `SequentialMLP` experts (FFN width
    `intermediate_size`), split over `expert_parallel` ranks. With `pipeline_parallel` > 1
    this rank builds its stage (layers split evenly; embedding first, output layer last).
    `layer_spec` replaces the local layer spec (e.g. a Transformer Engine spec, built from the
    TE stand-in in tests); `moe_grouped_gemm` sets the config flag grouped expert specs use.
    """
    from megatron.core import parallel_state

    moe = {}
    if num_experts:
        moe = dict(
            num_moe_experts=num_experts,
            moe_ffn_hidden_size=shape.intermediate_size,
            moe_router_topk=2,
            moe_router_dtype="fp32",
            moe_aux_loss_coeff=0.0,
            moe_router_load_balancing_type="none",
            moe_token_dispatcher_type="alltoall",
            expert_model_parallel_size=expert_parallel,
            moe_grouped_gemm=moe_grouped_gemm,
        )
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=shape.num_hidden_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.intermediate_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_key_value_heads,
        kv_channels=shape.head_dim,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        add_bias_linear=False,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        pipeline_dtype=params_dtype,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=True,
        params_dtype=params_dtype,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
        **moe,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec
        or _layer_spec(sequence_parallel, shape.num_hidden_layers, num_experts),
        vocab_size=shape.vocab_size,
        max_sequence_length=max_sequence_length,
        position_embedding_type="rope",
        rotary_base=int(shape.rope_theta),
        share_embeddings_and_output_weights=False,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
