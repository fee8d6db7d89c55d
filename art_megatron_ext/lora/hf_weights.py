"""Load a Hugging Face Llama/Qwen checkpoint into the Megatron GPT of `tiny_gpt` (any TP size).

Why: LoRA trained on the Megatron side is only meaningful for the serving side's model if the
base weights are the same. Q/K/V (weights and Qwen2's biases) are fused in Megatron's
per-group interleaved layout and gate/up in its per-rank [gate; up] layout (the same code as
the LoRA B layout, `hf_layout`). Tied embeddings have no `lm_head.weight` and no Megatron
output layer; a padded vocabulary gets zero rows past the checkpoint's.

Nothing is dropped silently: an HF tensor the mapping did not read (a bias, a norm, an
extra projection) is refused by name, as is one it needs and the checkpoint lacks.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .hf_layout import FUSED_GATE_UP, fuse_b_shard, fused_qkv


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = model_dir / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(model_dir / name)))
    return tensors


class UnmappedWeights(KeyError):
    """The checkpoint's tensors and the mapping disagree (extra or missing tensors)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class _Reads(dict):
    """The HF tensors, remembering which ones the mapping read."""

    def __init__(self, tensors: dict[str, torch.Tensor], where: str):
        super().__init__(tensors)
        self.read: set[str] = set()
        self.where = where

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self:
            raise UnmappedWeights(f"{self.where}: the checkpoint has no tensor {name!r}")
        self.read.add(name)
        return super().__getitem__(name)

    def check_all_read(self) -> None:
        unread = sorted(set(self) - self.read)
        if unread:
            shown = ", ".join(unread[:8]) + (f" and {len(unread) - 8} more" if unread[8:] else "")
            raise UnmappedWeights(
                f"{self.where}: the checkpoint has tensors the Megatron model does not map "
                f"(they would be dropped): {shown}. Nothing was loaded."
            )


def _global_name(model: torch.nn.Module, name: str, experts_offset: int = 0) -> str:
    """The TP = PP = EP = 1 name of this rank's parameter `name` (stage-local layer index ->
    global layer, local expert index -> global expert)."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        layer = model.decoder.layers[int(parts[2])]
        parts[2] = str(layer.layer_number - 1)
        if "local_experts" in parts:
            at = parts.index("local_experts") + 1
            parts[at] = str(int(parts[at]) + experts_offset)
    return ".".join(parts)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t` with zero rows appended up to `rows` (the padded vocabulary)."""
    if t.shape[0] == rows:
        return t
    if t.shape[0] > rows:
        raise ValueError(f"vocabulary of {t.shape[0]} rows does not fit {rows}")
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def attention_state(hf, h: str, m: str, shape, tp_rank: int, tp_size: int) -> dict:
    """One layer's attention entries on this TP rank (HF prefix `h`, Megatron prefix `m`):
    fused QKV (and its Qwen2 biases) in Megatron's per-group layout, q/k norms where the shape
    has them, the output projection's columns. Shared by the dense and the MoE mapping."""
    qkv = fused_qkv(shape)
    q, k, v = (hf[h + f"self_attn.{p}_proj.weight"] for p in "qkv")
    out = {m + "self_attention.linear_qkv.weight": fuse_b_shard(qkv, [q, k, v], tp_rank, tp_size)}
    if getattr(shape, "qkv_bias", False):
        biases = [hf[h + f"self_attn.{p}_proj.bias"][:, None] for p in "qkv"]
        fused = fuse_b_shard(qkv, biases, tp_rank, tp_size)  # [rows, 1]
        out[m + "self_attention.linear_qkv.bias"] = fused[:, 0]
    if getattr(shape, "qk_norm", False):
        out[m + "self_attention.q_layernorm.weight"] = hf[h + "self_attn.q_norm.weight"]
        out[m + "self_attention.k_layernorm.weight"] = hf[h + "self_attn.k_norm.weight"]
    o_proj = hf[h + "self_attn.o_proj.weight"]
    out[m + "self_attention.linear_proj.weight"] = o_proj.chunk(tp_size, dim=1)[tp_rank]
    return out


def gated_mlp_state(hf, h: str, m: str, rank: int, size: int) -> dict[str, torch.Tensor]:
    """A gated MLP's shards on `rank` of `size` (HF prefix `h`, Megatron prefix `m`): fc1
    `[gate shard; up shard]` (column parallel), fc2 the matching columns of down (row
    parallel). A dense layer's MLP over TP, an expert over expert TP."""
    gate, up = hf[h + "gate_proj.weight"], hf[h + "up_proj.weight"]
    return {
        m + "linear_fc1.weight": fuse_b_shard(FUSED_GATE_UP, [gate, up], rank, size),
        m + "linear_fc2.weight": hf[h + "down_proj.weight"].chunk(size, dim=1)[rank],
    }


def megatron_state_from_hf(
    hf: dict[str, torch.Tensor],
    shape,
    tp_rank: int = 0,
    tp_size: int = 1,
    *,
    te_layernorm: bool = False,
    padded_vocab: int | None = None,
) -> dict[str, torch.Tensor]:
    """Megatron GPT state-dict entries (this TP rank's shards) from HF Llama/Qwen tensors.

    `te_layernorm`: the layer norms live in the layernorm-fused linears of a Transformer Engine
    spec (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`) instead of
    `input_layernorm` / `pre_mlp_layernorm`. `padded_vocab`: the model's (padded) vocabulary
    rows over all TP ranks (default: the checkpoint's)."""
    vocab = padded_vocab or shape.vocab_size

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp_size, dim=0)[tp_rank]

    out = {
        "embedding.word_embeddings.weight": rows(_pad_rows(hf["model.embed_tokens.weight"], vocab)),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    if not getattr(shape, "tie_word_embeddings", False):
        out["output_layer.weight"] = rows(_pad_rows(hf["lm_head.weight"], vocab))
    for i in range(shape.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn_norm, mlp_norm = (
            ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight")
            if te_layernorm
            else ("input_layernorm.weight", "pre_mlp_layernorm.weight")
        )
        out[m + attn_norm] = hf[h + "input_layernorm.weight"]
        out[m + mlp_norm] = hf[h + "post_attention_layernorm.weight"]
        out.update(attention_state(hf, h, m, shape, tp_rank, tp_size))
        out.update(gated_mlp_state(hf, h + "mlp.", m + "mlp.", tp_rank, tp_size))
    return out


def load_hf_weights(model: torch.nn.Module, model_dir: str | Path, shape) -> None:
    """Copy the HF checkpoint's weights into `model` (before or after `attach_lora`).

    Every checkpoint tensor must be mapped and every mapped one present (`UnmappedWeights`
    names them); nothing is written before both hold."""
    from megatron.core import parallel_state

    from art_megatron_ext.compat import unwrap_model

    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    hf = _Reads(_read_safetensors(Path(model_dir)), str(model_dir))
    inner = unwrap_model(model)
    # global layer names: a pipeline stage holds layers from layer_number - 1 on
    params = {_global_name(inner, n): p for n, p in inner.named_parameters()}
    te_layernorm = any(name.endswith("linear_qkv.layer_norm_weight") for name in params)
    vocab_param = params.get("embedding.word_embeddings.weight", params.get("output_layer.weight"))
    padded = None if vocab_param is None else vocab_param.shape[0] * tp_size
    state = megatron_state_from_hf(
        hf, shape, tp_rank, tp_size, te_layernorm=te_layernorm, padded_vocab=padded
    )
    if getattr(shape, "tie_word_embeddings", False) and "output_layer.weight" in params:
        # a tied model's last pipeline stage holds a copy of the embedding as its output layer
        embedding = _pad_rows(hf["model.embed_tokens.weight"], padded)
        state["output_layer.weight"] = embedding.chunk(tp_size, dim=0)[tp_rank]
    hf.check_all_read()
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        # a stage holds its own layers (and the embedding / output layer where they live)
        state = {n: t for n, t in state.items() if n in params}
    missing = sorted(set(state) - set(params))
    if missing:
        raise UnmappedWeights(f"{model_dir}: Megatron model has no parameter {missing[0]}")
    unset = sorted(n for n in set(params) - set(state) if ".lora." not in n)
    if unset:
        raise UnmappedWeights(
            f"{model_dir}: no checkpoint tensor maps to Megatron parameter(s) {unset[:8]}"
        )
    with torch.no_grad():
        for name, value in state.items():
            target = params[name]
            if target.shape != value.shape:
                raise ValueError(
                    f"{model_dir}: {name} is {tuple(value.shape)} from HF, "
                    f"{tuple(target.shape)} in the Megatron model"
                )
            target.copy_(value.to(target.dtype))
