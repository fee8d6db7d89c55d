"""Load a Hugging Face DeepSeek-V3 checkpoint into `deepseek_gpt.build_deepseek_gpt`'s model.

Why: the trainer must start from the served weights exactly. The renames (HF -> Megatron):
- attention (MLA): `q_a_proj` -> `linear_q_down_proj`, `q_a_layernorm` -> `q_layernorm`,
  `q_b_proj` -> `linear_q_up_proj` (or `q_proj` -> `linear_q_proj` without a q rank),
  `kv_a_proj_with_mqa` -> `linear_kv_down_proj`, `kv_a_layernorm` -> `kv_layernorm`,
  `kv_b_proj` -> `linear_kv_up_proj`, `o_proj` -> `linear_proj`. Both sides lay the heads out
  the same way ([nope; rope] per query head, [nope; v] per kv_b head, [latent; rope] in the
  kv down projection), so each is the same matrix; tensor parallel splits the output rows of
  the column-parallel ones (the local spec shards the down projections too) and the columns
  of `linear_proj`;
- MoE layers: `mlp.gate.weight` -> `mlp.router.weight`, `mlp.gate.e_score_correction_bias`
  -> the router's `expert_bias` buffer (fp32), routed experts as in Qwen3-MoE
  (`hf_moe_weights`: SequentialMLP or grouped, over EP and expert TP), the shared expert
  `mlp.shared_experts.{gate,up,down}_proj` -> `mlp.shared_experts.linear_fc1/2` (over TP);
- dense layers' MLP, norms, embedding and output layer as in the dense mapping, the
  vocabulary padded when the model's is.
Nothing is dropped silently: an unread tensor is refused by name, except the multi-token
prediction layers' (`model.layers.{num_hidden_layers + k}.*`), which are not part of the
causal LM (`hf_deepseek` docstring).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .hf_deepseek import DeepseekShape
from .hf_moe_weights import copy_moe_state, moe_targets
from .hf_weights import _pad_rows, _read_safetensors, _Reads, gated_mlp_state


def mla_attention_state(hf, h: str, m: str, shape: DeepseekShape, rank: int, size: int) -> dict:
    """One layer's MLA entries on tensor-parallel `rank` of `size` (HF prefix `h`, Megatron
    prefix `m`)."""

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(size, dim=0)[rank]

    a, o = h + "self_attn.", m + "self_attention."
    out = {}
    if shape.q_lora_rank is None:
        out[o + "linear_q_proj.weight"] = rows(hf[a + "q_proj.weight"])
    else:
        out[o + "linear_q_down_proj.weight"] = rows(hf[a + "q_a_proj.weight"])
        out[o + "q_layernorm.weight"] = hf[a + "q_a_layernorm.weight"]
        out[o + "linear_q_up_proj.weight"] = rows(hf[a + "q_b_proj.weight"])
    out[o + "linear_kv_down_proj.weight"] = rows(hf[a + "kv_a_proj_with_mqa.weight"])
    out[o + "kv_layernorm.weight"] = hf[a + "kv_a_layernorm.weight"]
    out[o + "linear_kv_up_proj.weight"] = rows(hf[a + "kv_b_proj.weight"])
    out[o + "linear_proj.weight"] = hf[a + "o_proj.weight"].chunk(size, dim=1)[rank]
    return out


def megatron_deepseek_state_from_hf(
    hf,
    shape: DeepseekShape,
    tp_rank: int = 0,
    tp_size: int = 1,
    etp_rank: int = 0,
    etp_size: int = 1,
    *,
    padded_vocab: int | None = None,
) -> dict[str, torch.Tensor]:
    """Megatron state-dict entries in global names (every layer and expert) from HF DeepSeek-V3
    tensors: this TP rank's shards of attention, dense MLPs, shared experts and vocabulary, this
    expert-TP rank's shards of every routed expert."""
    vocab = padded_vocab or shape.vocab_size

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp_size, dim=0)[tp_rank]

    out = {
        "embedding.word_embeddings.weight": rows(_pad_rows(hf["model.embed_tokens.weight"], vocab)),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
        "output_layer.weight": rows(_pad_rows(hf["lm_head.weight"], vocab)),
    }
    for i in range(shape.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        out.update(mla_attention_state(hf, h, m, shape, tp_rank, tp_size))
        if i in shape.dense_layers:
            out.update(gated_mlp_state(hf, h + "mlp.", m + "mlp.", tp_rank, tp_size))
            continue
        out[m + "mlp.router.weight"] = hf[h + "mlp.gate.weight"]
        out[m + "mlp.router.expert_bias"] = hf[h + "mlp.gate.e_score_correction_bias"].float()
        for e in range(shape.num_experts):
            x, me = f"{h}mlp.experts.{e}.", f"{m}mlp.experts.local_experts.{e}."
            out.update(gated_mlp_state(hf, x, me, etp_rank, etp_size))
        if shape.n_shared_experts:
            shared = "mlp.shared_experts."
            out.update(gated_mlp_state(hf, h + shared, m + shared, tp_rank, tp_size))
    return out


def _mark_mtp_read(hf: _Reads, shape: DeepseekShape) -> None:
    """The multi-token-prediction layers' tensors count as read (they are not mapped on
    purpose: not part of the causal LM)."""
    first = shape.num_hidden_layers
    for name in hf:
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and int(parts[2]) >= first:
            hf.read.add(name)


def load_hf_deepseek_weights(
    model: torch.nn.Module, model_dir: str | Path, shape: DeepseekShape
) -> None:
    """Copy the HF checkpoint's weights into this rank's `model` (its pipeline stage, its
    expert-parallel share of the experts, its TP shards); every Megatron parameter and each
    router's expert bias must be set, and nothing is written unless all are."""
    from megatron.core import parallel_state as ps

    from art_megatron_ext.compat import unwrap_model

    tp = ps.get_tensor_model_parallel_world_size()
    targets = moe_targets(unwrap_model(model))
    vocab_rows = next(
        (
            targets[n].shape[0]
            for n in ("embedding.word_embeddings.weight", "output_layer.weight")
            if n in targets
        ),
        None,
    )
    hf = _Reads(_read_safetensors(Path(model_dir)), str(model_dir))
    _mark_mtp_read(hf, shape)
    state = megatron_deepseek_state_from_hf(
        hf,
        shape,
        ps.get_tensor_model_parallel_rank(),
        tp,
        ps.get_expert_tensor_parallel_rank(),
        ps.get_expert_tensor_parallel_world_size(),
        padded_vocab=None if vocab_rows is None else vocab_rows * tp,
    )
    hf.check_all_read()
    copy_moe_state(model, state, shape, str(model_dir))
