"""The Megatron-core GPT for a DeepSeek-V3 shape (`hf_deepseek.DeepseekShape`).

Why a module of its own: the shape module reads the checkpoint's config strictly and needs no
Megatron; this one turns the shape into Megatron's settings (multi-latent attention on the
local spec with `mla_core_attention.SdpaCoreAttention`, HF's rope frequencies set on each
layer's rotary embedding, sigmoid group-limited routing with the expert bias, the shared
expert, dense first layers) and builds the model.
"""

from __future__ import annotations

import torch

from .hf_config import padded_vocab_size
from .hf_deepseek import DeepseekShape


def build_deepseek_gpt(
    shape: DeepseekShape,
    *,
    params_dtype: torch.dtype = torch.float32,
    max_sequence_length: int = 256,
    make_vocab_size_divisible_by: int = 1,
    grouped_experts: bool = False,
    **config_overrides,
):
    """A local-spec (no Transformer Engine) Megatron `GPTModel` with multi-latent attention and
    `shape`'s dense/MoE layer pattern, for this rank's pipeline stage; Megatron's parallel state
    must be set. `config_overrides` go to the `MLATransformerConfig`. At TP > 1 sequence
    parallelism is on (Megatron requires it with MoE) and every norm is sequence-parallel. The
    core attention is `mla_core_attention.SdpaCoreAttention` (Megatron's local one has no
    separate key and value head widths). The vocabulary is padded as Megatron trainers pad it
    (`make_vocab_size_divisible_by` times TP); the loader zero-fills the padded rows and the
    stream never sends them. Routed experts are Megatron's `SequentialMLP`, or one
    `ArtGroupedMLP` per layer with `grouped_experts` (the loader and the stream map both; the
    stream needs expert-TP 1 for grouped experts)."""
    import dataclasses

    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from art_megatron_ext.compat import mla_rotary_modules, set_rotary_inv_freq

    from .hf_moe_weights import _sequence_parallel_norms, _with_grouped_experts, parallel_defaults
    from .mla_core_attention import SdpaCoreAttention
    from .tiny_gpt import (
        gated_rmsnorm_settings,
        local_cpu_settings,
        moe_layer_settings,
        moe_router_settings,
    )

    parallel_defaults(config_overrides)
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
        **gated_rmsnorm_settings(shape.rms_norm_eps),
        **local_cpu_settings(params_dtype),
        **moe_layer_settings(shape),
        moe_shared_expert_intermediate_size=(
            shape.moe_intermediate_size * shape.n_shared_experts or None
        ),
        moe_router_topk=shape.top_k,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=shape.routed_scaling_factor,
        moe_router_num_groups=shape.n_group if grouped else None,
        moe_router_group_topk=shape.topk_group if grouped else None,
        **moe_router_settings(),
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
    if grouped_experts:
        spec = _with_grouped_experts(spec, shape.num_experts)
    model = GPTModel(
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(
            shape.vocab_size, make_vocab_size_divisible_by, config.tensor_model_parallel_size
        ),
        max_sequence_length=max_sequence_length,
        position_embedding_type="rope",
        rotary_base=int(shape.rope_theta),
        share_embeddings_and_output_weights=False,
    )
    inv_freq = shape.inv_freq()
    for rotary in mla_rotary_modules(model):
        set_rotary_inv_freq(rotary, inv_freq)
    return model
