"""Stream a Megatron GPT's full weights in the served model's (Hugging Face) names.

Why: a full-weight update ships the trainer's weights to vLLM, which loads checkpoint-format
tensors by their HF names (`model.layers.3.self_attn.q_proj.weight`). Megatron holds them
fused and sharded: Q/K/V in one per-group interleaved `linear_qkv`, gate/up in one per-rank
`[gate; up]` `linear_fc1`, each split over tensor-parallel ranks (rows for column-parallel
linears and the vocabulary, columns for row-parallel ones). This is the inverse of
`lora.hf_weights.megatron_state_from_hf` and uses the same fused layouts (`lora.hf_layout`).

Memory: one layer at a time. The TP shards of a layer's tensors are all-gathered, handed to
`sink(name, tensor)` and dropped before the next layer, so the peak beyond the model is one
layer's full tensors, not the model's. Every TP rank takes part in the gathers (they are
collectives); by default only TP rank 0 calls the sink. The receipt carries the digest of
exactly what was handed to the sink, in order (`art_protocol.weights_digest`), which the
server computes over what it received.

Scope: the dense Llama-style GPT of `lora.tiny_gpt` (local or Transformer Engine spec, any TP
size), one pipeline stage. MoE experts and pipeline stages are refused by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from art_megatron_ext.lora.hf_layout import split_fused_b
from art_protocol.weights_digest import WeightsDigest


@dataclass(frozen=True)
class StreamReceipt:
    """What one stream sent: tensors, bytes, layers and the digest of them in order."""

    tensors: int
    bytes: int
    layers: int
    digest: str


def _tp():
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None, 1, 0
    return (
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
    )


def _gather(shard: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """The full tensor from every TP rank's shard, concatenated along `dim`."""
    if size == 1:
        return shard.detach().clone()
    parts = [torch.empty_like(shard) for _ in range(size)]
    torch.distributed.all_gather(parts, shard.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _check_scope(params: dict[str, torch.Tensor]) -> None:
    from megatron.core import parallel_state

    if (
        parallel_state.model_parallel_is_initialized()
        and parallel_state.get_pipeline_model_parallel_world_size() > 1
    ):
        raise NotImplementedError(
            "stream_hf_weights: pipeline_model_parallel_size > 1 is not supported yet (each "
            "stage would stream its own layers; say so in the issue tracker)"
        )
    experts = [n for n in params if ".mlp.experts." in n or ".mlp.router." in n]
    if experts:
        raise NotImplementedError(
            f"stream_hf_weights: MoE layers ({experts[0]}) are not supported yet; the dense "
            "Llama-style GPT is"
        )


def _layer_tensors(
    params: dict[str, torch.Tensor], i: int, shape, te_layernorm: bool, group, size: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Layer i's HF tensors, in checkpoint order."""
    m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
    attn_norm, mlp_norm = (
        ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight")
        if te_layernorm
        else ("input_layernorm.weight", "pre_mlp_layernorm.weight")
    )
    qkv = SimpleNamespace(
        target="linear_qkv",
        gated=False,
        qkv_layout=(
            shape.num_key_value_heads,
            shape.num_attention_heads // shape.num_key_value_heads,
            shape.head_dim,
        ),
    )
    fc1 = SimpleNamespace(target="linear_fc1", gated=True, qkv_layout=None)

    def shards(name: str) -> list[torch.Tensor]:
        full = _gather(params[m + name], 0, group, size)
        return list(full.chunk(size, dim=0))

    yield h + "input_layernorm.weight", params[m + attn_norm].detach().clone()
    q, k, v = split_fused_b(qkv, shards("self_attention.linear_qkv.weight"))
    yield h + "self_attn.q_proj.weight", q
    yield h + "self_attn.k_proj.weight", k
    yield h + "self_attn.v_proj.weight", v
    yield (
        h + "self_attn.o_proj.weight",
        _gather(params[m + "self_attention.linear_proj.weight"], 1, group, size),
    )
    yield h + "post_attention_layernorm.weight", params[m + mlp_norm].detach().clone()
    gate, up = split_fused_b(fc1, shards("mlp.linear_fc1.weight"))
    yield h + "mlp.gate_proj.weight", gate
    yield h + "mlp.up_proj.weight", up
    yield h + "mlp.down_proj.weight", _gather(params[m + "mlp.linear_fc2.weight"], 1, group, size)


def stream_hf_weights(
    model: torch.nn.Module,
    shape,
    sink: Callable[[str, torch.Tensor], None],
    *,
    send: bool | None = None,
) -> StreamReceipt:
    """Hand every weight of `model` to `sink(hf_name, full_tensor)`, one layer at a time.

    Collective over the tensor-parallel group (call it on every TP rank). `send` says whether
    this rank calls the sink (default: TP rank 0). `shape` is the model's `GptShape`. Returns
    the receipt (digest, tensors, bytes) of what was sent, the same on every rank.
    """
    group, size, rank = _tp()
    send = rank == 0 if send is None else send
    params = dict(model.named_parameters())
    _check_scope(params)
    te_layernorm = any(n.endswith("linear_qkv.layer_norm_weight") for n in params)
    digest = WeightsDigest()

    def emit(name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.contiguous()
        digest.update(
            name, str(tensor.dtype), tuple(tensor.shape), tensor.view(torch.uint8).numpy()
        )
        if send:
            sink(name, tensor)

    emit(
        "model.embed_tokens.weight",
        _gather(params["embedding.word_embeddings.weight"], 0, group, size),
    )
    layers = shape.num_hidden_layers
    for i in range(layers):
        for name, tensor in _layer_tensors(params, i, shape, te_layernorm, group, size):
            emit(name, tensor)
    emit("model.norm.weight", params["decoder.final_layernorm.weight"].detach().clone())
    if "output_layer.weight" in params:  # untied: its own tensor
        emit("lm_head.weight", _gather(params["output_layer.weight"], 0, group, size))
    return StreamReceipt(
        tensors=digest.tensors, bytes=digest.bytes, layers=layers, digest=digest.hexdigest()
    )
