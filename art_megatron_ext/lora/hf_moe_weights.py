"""The Hugging Face Qwen3-MoE tiny model as a Megatron-core GPT: shape, model and weights.

Why: routes served by vLLM can only be replayed on the training side if the trainer's model
is the served one, router included. This builds a local-spec (no Transformer Engine) GPT with
QK-norm, dense layers where the HF config says `mlp_only_layers` / `decoder_sparse_step`, and
top-k MoE layers of `SequentialMLP` experts elsewhere, and copies the HF weights in:
- attention as in the dense Llama mapping (`hf_weights`): Q/K/V fused per query group;
  `q_norm` / `k_norm` -> `q_layernorm` / `k_layernorm` (per-head RMSNorm, same in both);
- router `mlp.gate` -> `mlp.router`; expert e's gate/up -> `local_experts.e.linear_fc1`
  (`[gate; up]`), down -> `linear_fc2`;
- HF's router is softmax over all experts, top-k, then renormalized when `norm_topk_prob`:
  that is Megatron's top-k on the logits followed by a softmax over the k (`pre_softmax`
  off), so the same experts and weights; without `norm_topk_prob` it is `pre_softmax` on.
Pipeline, expert and tensor parallelism are supported (a stage loads its own layers, found by
their global `layer_number`; an expert-parallel rank loads its own experts; a tensor-parallel
rank its shards of attention, dense MLPs and vocabulary, an expert-tensor-parallel rank its
shards of every expert). At TP > 1 Megatron requires sequence parallelism with MoE, so
`build_moe_gpt` turns it on with sequence-parallel norms.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from .hf_config import UnmappedConfig, check_dense, read_config, rope_inv_freq
from .hf_weights import (
    UnmappedWeights,
    _global_name,
    _read_safetensors,
    _Reads,
    attention_state,
    gated_mlp_state,
)

#: Qwen3-MoE fields mapped here beyond the dense ones (`hf_config.DENSE_FIELDS`).
MOE_FIELDS = frozenset(
    {
        "moe_intermediate_size",
        "num_experts",
        "num_local_experts",
        "num_experts_per_tok",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
    }
)


@dataclass(frozen=True)
class MoeShape:
    """The dimensions of a Qwen3-MoE causal LM (names follow Hugging Face's config)."""

    qk_norm: ClassVar[bool] = True  # Qwen3-MoE's attention always has q/k norms

    hidden_size: int
    intermediate_size: int  # dense layers' FFN width
    moe_intermediate_size: int  # each expert's FFN width
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    dense_layers: tuple[int, ...]  # 0-based indices of layers with a dense MLP
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    @classmethod
    def from_hf_config(cls, path: str | Path) -> MoeShape:
        """Read a Qwen3-MoE `config.json` (or the directory holding it); `UnmappedConfig`
        names every field the Megatron model would not carry."""
        cfg = read_config(path)
        if cfg.get("model_type") != "qwen3_moe":
            raise UnmappedConfig(
                f"{path}: model_type {cfg.get('model_type')!r} is not mapped by the Qwen3-MoE "
                "mapping (qwen3_moe; deepseek_v3: lora.hf_deepseek.DeepseekShape); nothing was "
                "built"
            )
        theta, scaling = check_dense(cfg, str(path), MOE_FIELDS)
        if cfg.get("tie_word_embeddings"):
            raise UnmappedConfig(f"{path}: tied embeddings are not supported by the MoE mapping")
        if scaling is not None:
            raise UnmappedConfig(f"{path}: rope scaling is not supported by the MoE mapping")
        layers = cfg["num_hidden_layers"]
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        step = cfg.get("decoder_sparse_step", 1)
        only = set(cfg.get("mlp_only_layers") or [])
        dense = tuple(i for i in range(layers) if i in only or not experts or (i + 1) % step)
        heads = cfg["num_attention_heads"]
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            moe_intermediate_size=cfg["moe_intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            num_experts=experts,
            top_k=cfg["num_experts_per_tok"],
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            dense_layers=dense,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
        )

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if i not in self.dense_layers)


def build_moe_gpt(
    shape: MoeShape,
    *,
    params_dtype: torch.dtype = torch.float32,
    max_sequence_length: int = 256,
    grouped_experts: bool = False,
    **config_overrides,
):
    """A local-spec `GPTModel` with `shape`'s dense/MoE layer pattern on CPU, for this rank's
    pipeline stage; Megatron's parallel state must be set. `config_overrides` go to the
    `TransformerConfig` (parallel sizes, recompute, `moe_enable_routing_replay`, ...).
    `grouped_experts`: the experts are one `ArtGroupedMLP` per layer (`art_moe_layer_spec`)
    instead of Megatron's `SequentialMLP`; the loader and the stream map both. The tensor and
    expert-tensor parallel sizes default to the parallel state's; at TP > 1 sequence
    parallelism is on (Megatron requires it with MoE) and the norms are sequence-parallel.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from .tiny_gpt import (
        gated_rmsnorm_settings,
        local_cpu_settings,
        moe_layer_settings,
        moe_router_settings,
    )

    parallel_defaults(config_overrides)
    config = TransformerConfig(
        num_layers=shape.num_hidden_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.intermediate_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_key_value_heads,
        kv_channels=shape.head_dim,
        qk_layernorm=True,
        **gated_rmsnorm_settings(shape.rms_norm_eps),
        **local_cpu_settings(params_dtype),
        **moe_layer_settings(shape),
        moe_router_topk=shape.top_k,
        moe_router_pre_softmax=not shape.norm_topk_prob,
        moe_router_score_function="softmax",
        **moe_router_settings(),
        **config_overrides,
    )
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    if config.sequence_parallel:
        spec = _sequence_parallel_norms(spec)
    if grouped_experts:
        spec = _with_grouped_experts(spec, shape.num_experts)
    from .tiny_gpt import set_rope_inv_freq

    model = GPTModel(
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        config=config,
        transformer_layer_spec=spec,
        vocab_size=shape.vocab_size,
        max_sequence_length=max_sequence_length,
        position_embedding_type="rope",
        rotary_base=int(shape.rope_theta),
        share_embeddings_and_output_weights=False,
    )
    set_rope_inv_freq(model, rope_inv_freq(shape.head_dim, shape.rope_theta, None))
    return model


def parallel_defaults(config_overrides: dict) -> None:
    """Fill an MoE model's parallel sizes from Megatron's parallel state where the caller did
    not set them: tensor, expert-tensor and pipeline sizes, and sequence parallelism at TP > 1
    (Megatron requires it with MoE). Without the pipeline size every stage would build every
    layer."""
    from megatron.core import parallel_state as ps

    tp = config_overrides.setdefault(
        "tensor_model_parallel_size", ps.get_tensor_model_parallel_world_size()
    )
    config_overrides.setdefault(
        "expert_tensor_parallel_size", ps.get_expert_tensor_parallel_world_size()
    )
    config_overrides.setdefault("sequence_parallel", tp > 1)
    config_overrides.setdefault(
        "pipeline_model_parallel_size", ps.get_pipeline_model_parallel_world_size()
    )


def _sequence_parallel_norms(block):
    """`block` with every RMSNorm (layer, final, q/k or MLA's q_a/kv_a norms) as
    `SequenceParallelRMSNorm`: Megatron's torch norm refuses `sequence_parallel`, which MoE
    at TP > 1 requires."""
    import dataclasses

    from megatron.core.transformer.identity_op import IdentityOp

    from .tiny_gpt import SequenceParallelRMSNorm as Norm

    layers = []
    for layer in block.layer_specs:
        sub = layer.submodules
        attn = sub.self_attention
        norms = {  # q/k norms (Qwen3), q_a / kv_a norms (MLA), where the spec has them
            name: Norm
            for name in ("q_layernorm", "k_layernorm", "kv_layernorm")
            if getattr(attn.submodules, name, IdentityOp) is not IdentityOp
        }
        attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules, **norms))
        sub = dataclasses.replace(
            sub, input_layernorm=Norm, pre_mlp_layernorm=Norm, self_attention=attn
        )
        layers.append(dataclasses.replace(layer, submodules=sub))
    return dataclasses.replace(block, layer_specs=layers, layer_norm=Norm)


def _with_grouped_experts(block, num_experts: int):
    """`block` (a decoder block spec) with every MoE layer's experts as `ArtGroupedMLP`."""
    import dataclasses

    from megatron.core.transformer.moe.moe_layer import MoELayer

    from art_megatron_ext.moe import art_moe_layer_spec

    layers = []
    for layer in block.layer_specs:
        if getattr(layer.submodules.mlp, "func", None) is MoELayer:
            sub = dataclasses.replace(layer.submodules, mlp=art_moe_layer_spec(num_experts))
            layer = dataclasses.replace(layer, submodules=sub)
        layers.append(layer)
    return dataclasses.replace(block, layer_specs=layers)


def grouped_expert_state(state: dict[str, torch.Tensor], shape: MoeShape) -> dict:
    """`state` (per-expert `SequentialMLP` names) with each MoE layer's experts stacked in
    `ArtGroupedMLP`'s layout: `mlp.experts.linear_fc1.weight` [E, hidden, 2 * ffn] (each
    expert's [gate; up] transposed) and `linear_fc2.weight` [E, ffn, hidden]."""
    out = {n: t for n, t in state.items() if ".mlp.experts.local_experts." not in n}
    for i in shape.moe_layers:
        m = f"decoder.layers.{i}.mlp.experts."
        for fc in ("linear_fc1", "linear_fc2"):
            experts = range(shape.num_experts)
            out[f"{m}{fc}.weight"] = torch.stack(
                [state[f"{m}local_experts.{e}.{fc}.weight"].t() for e in experts]
            )
    return out


def megatron_moe_state_from_hf(
    hf: dict[str, torch.Tensor],
    shape: MoeShape,
    tp_rank: int = 0,
    tp_size: int = 1,
    etp_rank: int = 0,
    etp_size: int = 1,
) -> dict[str, torch.Tensor]:
    """Megatron GPT state-dict entries from HF Qwen3-MoE tensors: this tensor-parallel rank's
    shards of the attention, dense MLPs and vocabulary, and this expert-tensor-parallel rank's
    shards of every expert (all experts, in global names; a loader keeps its EP share)."""

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp_size, dim=0)[tp_rank]

    out = {
        "embedding.word_embeddings.weight": rows(hf["model.embed_tokens.weight"]),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
        "output_layer.weight": rows(hf["lm_head.weight"]),
    }
    for i in range(shape.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        out.update(attention_state(hf, h, m, shape, tp_rank, tp_size))
        if i in shape.dense_layers:
            out.update(gated_mlp_state(hf, h + "mlp.", m + "mlp.", tp_rank, tp_size))
            continue
        out[m + "mlp.router.weight"] = hf[h + "mlp.gate.weight"]
        for e in range(shape.num_experts):
            x, me = f"{h}mlp.experts.{e}.", f"{m}mlp.experts.local_experts.{e}."
            out.update(gated_mlp_state(hf, x, me, etp_rank, etp_size))
    return out


GROUPED_FC1 = ".mlp.experts.linear_fc1.weight"
GROUPED_NAMES = (GROUPED_FC1, ".mlp.experts.linear_fc2.weight")


def load_hf_moe_weights(model: torch.nn.Module, model_dir: str | Path, shape: MoeShape) -> None:
    """Copy the HF checkpoint's weights into this rank's `model` (its pipeline stage, its
    expert-parallel share of the experts); every Megatron parameter must be set."""
    from megatron.core import parallel_state as ps

    hf = _Reads(_read_safetensors(Path(model_dir)), str(model_dir))
    state = megatron_moe_state_from_hf(
        hf,
        shape,
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_expert_tensor_parallel_rank(),
        ps.get_expert_tensor_parallel_world_size(),
    )
    hf.check_all_read()
    copy_moe_state(model, state, shape, str(model_dir))


def moe_targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a loader writes and the stream reads: every parameter, plus each router's
    `expert_bias` (a buffer: DeepSeek's score-correction bias)."""
    targets = dict(model.named_parameters())
    targets.update(
        (name, buf) for name, buf in model.named_buffers() if name.endswith(".router.expert_bias")
    )
    return targets


def copy_moe_state(model: torch.nn.Module, state: dict, shape, where: str) -> None:
    """Write `state` (global names: every layer, every expert, this rank's TP/ETP shards) into
    this rank's `model`: its pipeline stage's layers, its expert-parallel share of the experts,
    `SequentialMLP` or grouped experts. Nothing is written unless every target has a value and,
    on a whole model, every value a target (`UnmappedWeights`), with matching shapes."""
    from megatron.core import parallel_state as ps

    from art_megatron_ext.compat import unwrap_model

    ep_size = ps.get_expert_model_parallel_world_size()
    if shape.num_experts % ep_size:
        raise ValueError(f"{where}: {shape.num_experts} experts do not split over EP={ep_size}")
    offset = ps.get_expert_model_parallel_rank() * (shape.num_experts // ep_size)
    model = unwrap_model(model)
    params = {_global_name(model, n, offset): p for n, p in moe_targets(model).items()}
    if any(n.endswith(GROUPED_FC1) for n in params):
        local = shape.num_experts // ep_size
        state = {
            n: t[offset : offset + local] if n.endswith(GROUPED_NAMES) else t
            for n, t in grouped_expert_state(state, shape).items()
        }
    unset = sorted(set(params) - set(state))
    whole = ep_size == 1 and ps.get_pipeline_model_parallel_world_size() == 1
    missing = sorted(set(state) - set(params)) if whole else []
    if missing or unset:
        raise UnmappedWeights(
            f"{where}: HF -> Megatron mapping mismatch: no Megatron parameter for "
            f"{missing[:3]}, no HF weight for {unset[:3]}"
        )
    for name, target in params.items():
        if target.shape != state[name].shape:
            raise ValueError(
                f"{where}: {name} is {tuple(state[name].shape)} from HF, "
                f"{tuple(target.shape)} in the Megatron model"
            )
    with torch.no_grad():
        for name, target in params.items():
            target.copy_(state[name].to(target.dtype))
