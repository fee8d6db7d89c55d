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
collectives); by default only global rank 0 calls the sink (one sender, whatever the data parallel
replicas: each replica runs the same gathers in its own groups). The receipt carries the digest of
exactly what was handed to the sink (`art_protocol.weights_digest`, over the set of named tensors),
which the server computes over the files it received (`hf_checkpoint.write_hf_checkpoint` writes
them). Only the sender computes it: the other ranks never copy a tensor to the host or hash it
(their receipt counts the same tensors and bytes, digest None).

MoE (the Qwen3-MoE GPT of `lora.hf_moe_weights.build_moe_gpt`, inverse of
`megatron_moe_state_from_hf`): a layer with a router streams `mlp.gate.weight` (the router),
then every expert's `mlp.experts.{e}.{gate,up,down}_proj.weight` in global expert order;
`q_layernorm` / `k_layernorm` stream as `self_attn.q_norm` / `k_norm` wherever they exist.
Each expert-parallel rank holds `num_experts / EP` experts (rank r: global
experts r * local .. (r + 1) * local - 1); a layer's local experts are stacked and
all-gathered over the EP group, so the peak is still one layer's experts. Every EP rank takes
part; by default only global rank 0 calls the sink.

The model may be wrapped (Megatron's `DistributedDataParallel`, `Float16Module` of a bf16
trainer): names are looked up on the model inside. Parameters may live on the GPU: the sink
gets them where they are, and the sender's digest is taken from a pinned host copy made here
(one buffer, reused). A padded
vocabulary (`build_gpt(make_vocab_size_divisible_by=...)`) is trimmed to the checkpoint's rows;
tied embeddings send `model.embed_tokens.weight` once and no `lm_head.weight`, as the served
checkpoint has them.

DeepSeek-V3 (`lora.hf_deepseek`): a layer with multi-latent attention streams its seven MLA
tensors (`mla_stream`); an MoE layer also streams its router's `expert_bias` buffer as
`mlp.gate.e_score_correction_bias` and its shared expert as `mlp.shared_experts.*`.

Scope: the dense Llama/Qwen GPT of `lora.tiny_gpt` (local or Transformer Engine spec, any TP size,
q/k/v biases, q/k norms), the MoE GPT above (local spec, any TP, EP and expert-TP size as its
loader; experts as `SequentialMLP`, our `ArtGroupedMLP` or `TEGroupedMLP`, the grouped ones at
expert-TP 1) and the DeepSeek-V3 GPT, over pipeline stages too: each stage makes its own
tensors whole and, in the sender's pipeline group, relays them to the sender on the first
stage (`stage_relay`; the sender must sit on the first stage). Refused by name before anything
is sent: virtual pipeline stages, a `HybridModel`, a shared-expert gate and any other expert
parameter the
HF mappings do not read.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from art_megatron_ext.lora.hf_layout import FUSED_GATE_UP, fused_qkv, split_fused_b
from art_megatron_ext.lora.hf_moe_weights import moe_targets
from art_megatron_ext.weights.mla_stream import mla_tensors
from art_megatron_ext.weights.stage_relay import StageRelay
from art_protocol.weights_digest import WeightsDigest


@dataclass(frozen=True)
class StreamReceipt:
    """What one stream sent: tensors, bytes, layers and their digest. The digest is computed
    once, by the rank that sends; on the other ranks it is None (they never copy a tensor to
    the host or hash it)."""

    tensors: int
    bytes: int
    layers: int
    digest: str | None


class _HostStage:
    """The sender's host copy of a device tensor for its digest: one pinned buffer, grown to
    the largest tensor and reused, filled by an asynchronous copy (a pageable `.cpu()` of
    every parameter measured 1.44 GB/s on an H200, a pinned copy 54 GB/s)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def bytes_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`'s bytes on the host (uint8, 1-D), valid until the next call."""
        flat = tensor.reshape(-1).view(torch.uint8)
        if tensor.device.type == "cpu":
            return flat
        n = flat.numel()
        if self._buffer is None or self._buffer.numel() < n:
            self._buffer = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        host = self._buffer[:n]
        host.copy_(flat, non_blocking=True)
        torch.cuda.current_stream(tensor.device).synchronize()
        return host


def _group(kind: str) -> tuple:
    """(group, size, this rank) of Megatron's `kind` parallel group ("tensor_model" or
    "expert_model"); a world of one when no parallel state is set up."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None, 1, 0
    return tuple(
        getattr(parallel_state, f"get_{kind}_parallel_{what}")()
        for what in ("group", "world_size", "rank")
    )


def _shards(shard: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    """Every rank's `shard` (same shape on every rank), in rank order."""
    if size == 1:  # callers concatenate or split it: never a view of the parameter
        return [shard.detach()]
    parts = [torch.empty_like(shard) for _ in range(size)]
    torch.distributed.all_gather(parts, shard.detach().contiguous(), group=group)
    return parts


def _gather(shard: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """The full tensor from every TP rank's shard, concatenated along `dim`."""
    return torch.cat(_shards(shard, group, size), dim=dim)


def _gather_experts(local: list[torch.Tensor], group, size: int) -> list[torch.Tensor]:
    """Every expert's tensor in global order from each EP rank's local experts (rank r holds
    global experts r * len(local) .. (r + 1) * len(local) - 1)."""
    return [t for part in _shards(torch.stack(local), group, size) for t in part.unbind(0)]


def _global_rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _vocab_rows(full: torch.Tensor, vocab: int) -> torch.Tensor:
    """The checkpoint's `vocab` rows of a (padded) vocabulary tensor."""
    if full.shape[0] < vocab:
        raise ValueError(f"the model has {full.shape[0]} vocabulary rows, the shape {vocab}")
    return full[:vocab] if full.shape[0] > vocab else full


def _check_scope(params: dict[str, torch.Tensor]) -> None:
    from megatron.core import parallel_state

    if (
        parallel_state.model_parallel_is_initialized()
        and parallel_state.get_virtual_pipeline_model_parallel_world_size() not in (None, 1)
    ):
        raise NotImplementedError(
            "stream_hf_weights: virtual pipeline stages (interleaved schedules) are not "
            "streamed (one model chunk per stage is); nothing was streamed"
        )
    unmapped = [
        n
        for n in params
        if (".mlp.experts." in n and _expert_form(n) is None)
        or (".mlp.shared_experts." in n and not n.endswith(_SHARED_NAMES))
    ]
    if unmapped:
        raise NotImplementedError(
            f"stream_hf_weights: {unmapped[0]} is not an expert parameter the HF MoE mappings "
            "read (SequentialMLP local_experts.N, ArtGroupedMLP linear_fc1/2.weight [L, ...], "
            "TEGroupedMLP linear_fc1/2.weightN, a shared expert's linear_fc1/2.weight; a "
            "shared-expert gate is not mapped); nothing was streamed"
        )
    moe = any(n.endswith(".mlp.router.weight") for n in params)
    grouped = any(_expert_form(n) in ("grouped", "te") for n in params)
    if moe and grouped and _group("expert_tensor")[1] > 1:
        raise NotImplementedError(
            "stream_hf_weights: grouped experts at expert tensor parallel > 1 are not mapped "
            "(SequentialMLP experts are); nothing was streamed"
        )


_SHARED_NAMES = (".mlp.shared_experts.linear_fc1.weight", ".mlp.shared_experts.linear_fc2.weight")
_TE_GROUPED = re.compile(r"\.mlp\.experts\.linear_fc[12]\.weight\d+$")


def _expert_form(name: str) -> str | None:
    """Which expert module holds `name`: "sequential" (Megatron's `SequentialMLP`), "grouped"
    (our `ArtGroupedMLP`: one [L, in, out] tensor per linear), "te" (`TEGroupedMLP`: one
    `weightN` [out, in] per local expert), or None (not a mapped expert weight)."""
    if ".mlp.experts.local_experts." in name and name.endswith("weight"):
        return "sequential"
    if name.endswith((".mlp.experts.linear_fc1.weight", ".mlp.experts.linear_fc2.weight")):
        return "grouped"
    if _TE_GROUPED.search(name):
        return "te"
    return None


def _local_experts(params: dict[str, torch.Tensor], m: str) -> tuple[list, list]:
    """This rank's experts of layer `m` as ([fc1 [2 * ffn, hidden]], [fc2 [hidden, ffn]]), in
    local expert order, whichever expert module holds them (views, no copies)."""
    grouped = params.get(m + "mlp.experts.linear_fc1.weight")
    if grouped is not None:  # ArtGroupedMLP: [L, hidden, 2 * ffn] and [L, ffn, hidden]
        fc2 = params[m + "mlp.experts.linear_fc2.weight"]
        return [w.t() for w in grouped.unbind(0)], [w.t() for w in fc2.unbind(0)]
    te = m + "mlp.experts.linear_fc1.weight"
    if te + "0" in params:  # TEGroupedMLP: weight0..L-1, already [out, in]
        count = sum(1 for n in params if n.startswith(te))
        fc2 = m + "mlp.experts.linear_fc2.weight"
        return [params[f"{te}{j}"] for j in range(count)], [
            params[f"{fc2}{j}"] for j in range(count)
        ]
    prefix = m + "mlp.experts.local_experts."
    local = sorted({int(n[len(prefix) :].split(".")[0]) for n in params if n.startswith(prefix)})
    if local != list(range(len(local))) or not local:
        raise ValueError(f"stream_hf_weights: {prefix}N are {local}, not 0..n-1")
    return (
        [params[f"{prefix}{j}.linear_fc1.weight"] for j in local],
        [params[f"{prefix}{j}.linear_fc2.weight"] for j in local],
    )


def _moe_tensors(
    params: dict[str, torch.Tensor], m: str, h: str, fc1, ep: tuple, etp: tuple, tp: tuple
) -> Iterator[tuple[str, torch.Tensor]]:
    """An MoE layer's router (and its expert bias: DeepSeek's score-correction bias), every
    expert (all EP ranks'), and the shared expert where there is one, in HF names and order.
    Each local expert is first made whole over the expert-tensor-parallel group (fc1 column
    parallel, per rank `[gate shard; up shard]`; fc2 row parallel), then the EP group's
    experts are gathered; the shared expert is split over tensor parallel like a dense MLP."""
    yield h + "mlp.gate.weight", params[m + "mlp.router.weight"].detach().clone()
    bias = params.get(m + "mlp.router.expert_bias")
    if bias is not None:
        yield h + "mlp.gate.e_score_correction_bias", bias.detach().clone()
    local_fc1, local_fc2 = _local_experts(params, m)
    if etp[1] > 1:
        local_fc1 = [torch.cat(split_fused_b(fc1, _shards(w, *etp))) for w in local_fc1]
        local_fc2 = [_gather(w, 1, *etp) for w in local_fc2]
    ups = _gather_experts([w.detach() for w in local_fc1], *ep)
    downs = _gather_experts([w.detach() for w in local_fc2], *ep)
    for e, (up_gate, down) in enumerate(zip(ups, downs, strict=True)):
        gate, up = split_fused_b(fc1, [up_gate])
        yield f"{h}mlp.experts.{e}.gate_proj.weight", gate.contiguous()
        yield f"{h}mlp.experts.{e}.up_proj.weight", up.contiguous()
        yield f"{h}mlp.experts.{e}.down_proj.weight", down.contiguous().clone()
    shared = m + "mlp.shared_experts."
    if shared + "linear_fc1.weight" in params:
        gate, up = split_fused_b(fc1, _shards(params[shared + "linear_fc1.weight"], *tp))
        yield h + "mlp.shared_experts.gate_proj.weight", gate
        yield h + "mlp.shared_experts.up_proj.weight", up
        yield (
            h + "mlp.shared_experts.down_proj.weight",
            _gather(params[shared + "linear_fc2.weight"], 1, *tp),
        )


def _layer_tensors(
    params: dict[str, torch.Tensor],
    i: int,
    global_i: int,
    shape,
    group,
    size: int,
    ep: tuple,
    etp: tuple,
) -> Iterator[tuple[str, torch.Tensor]]:
    """This stage's layer `i` (global layer `global_i`)'s HF tensors, in checkpoint order."""
    m, h = f"decoder.layers.{i}.", f"model.layers.{global_i}."
    # A norm lives in its own module or in the layernorm-fused linear after it (TE specs);
    # a TE spec's MoE layer keeps `pre_mlp_layernorm` (its experts fuse no norm).
    attn_norm, mlp_norm = (
        fused if m + fused in params else plain
        for fused, plain in (
            ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
            ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
        )
    )
    fc1 = FUSED_GATE_UP

    def shards(name: str) -> list[torch.Tensor]:
        return _shards(params[m + name], group, size)

    yield h + "input_layernorm.weight", params[m + attn_norm].detach().clone()
    if m + "self_attention.linear_kv_up_proj.weight" in params:  # multi-latent attention
        yield from mla_tensors(params, m, h, shape, lambda t, d: _gather(t, d, group, size), size)
    else:
        yield from _gqa_tensors(params, m, h, shape, group, size)
    yield h + "post_attention_layernorm.weight", params[m + mlp_norm].detach().clone()
    if m + "mlp.router.weight" in params:
        yield from _moe_tensors(params, m, h, fc1, ep, etp, (group, size))
        return
    gate, up = split_fused_b(fc1, shards("mlp.linear_fc1.weight"))
    yield h + "mlp.gate_proj.weight", gate
    yield h + "mlp.up_proj.weight", up
    yield h + "mlp.down_proj.weight", _gather(params[m + "mlp.linear_fc2.weight"], 1, group, size)


def _gqa_tensors(
    params: dict[str, torch.Tensor], m: str, h: str, shape, group, size: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """A Llama/Qwen layer's attention: q/k/v (and Qwen2's biases) from the fused per-group
    `linear_qkv`, o_proj, Qwen3's q/k norms."""
    qkv = fused_qkv(shape)

    def shards(name: str) -> list[torch.Tensor]:
        return _shards(params[m + name], group, size)

    q, k, v = split_fused_b(qkv, shards("self_attention.linear_qkv.weight"))
    yield h + "self_attn.q_proj.weight", q
    yield h + "self_attn.k_proj.weight", k
    yield h + "self_attn.v_proj.weight", v
    if m + "self_attention.linear_qkv.bias" in params:  # Qwen2: q/k/v biases
        biases = split_fused_b(qkv, [b[:, None] for b in shards("self_attention.linear_qkv.bias")])
        for p, bias in zip("qkv", biases, strict=True):
            yield f"{h}self_attn.{p}_proj.bias", bias[:, 0].contiguous()
    yield (
        h + "self_attn.o_proj.weight",
        _gather(params[m + "self_attention.linear_proj.weight"], 1, group, size),
    )
    for hf_norm, mg_norm in (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")):
        norm = params.get(f"{m}self_attention.{mg_norm}.weight")
        if norm is not None:  # per-head RMSNorm, the same on every TP rank
            yield f"{h}self_attn.{hf_norm}.weight", norm.detach().clone()


def stream_hf_weights(
    model: torch.nn.Module,
    shape,
    sink: Callable[[str, torch.Tensor], None],
    *,
    send: bool | None = None,
) -> StreamReceipt:
    """Hand every weight of `model` to `sink(hf_name, full_tensor)`, one layer at a time.

    Collective over the tensor-parallel group and, for an MoE model, the expert-parallel group (call
    it on every TP and EP rank). `send` says whether this rank calls the sink (default: global rank
    0 only, or the one process when torch.distributed is not set up). `shape` is the model's
    `GptShape`, `MoeShape` or `DeepseekShape`. Returns the receipt of what was sent: tensors, bytes
    and layers on every rank, the digest on the sending rank only (None elsewhere).
    """
    from art_megatron_ext.compat import unwrap_model

    group, size, _ = _group("tensor_model")
    inner = unwrap_model(model)
    pattern = getattr(inner, "hybrid_layer_pattern", None)
    if pattern is not None:
        raise NotImplementedError(
            f"stream_hf_weights: a HybridModel (layer pattern {pattern!r}) is not streamed yet: "
            "GPT layer i's attention and MLP live in two hybrid layers "
            "(lora.layer_position.gpt_layer_pairs) and the final norm is decoder.final_norm; "
            "nothing was streamed"
        )
    params = moe_targets(inner)  # parameters and the routers' expert-bias buffers
    _check_scope(params)
    ep, etp = _group("expert_model")[:2], _group("expert_tensor")[:2]
    send = _global_rank() == 0 if send is None else send
    digest = WeightsDigest()  # counts on every rank; hashes on the sender only
    stage = _HostStage()
    vocab = shape.vocab_size

    def count(name: str, tensor: torch.Tensor) -> None:
        digest.add(name, str(tensor.dtype), tuple(tensor.shape), b"", _nbytes(tensor))

    def emit(name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.contiguous()
        if not send:
            count(name, tensor)
            return
        data = stage.bytes_of(tensor).numpy()
        digest.update(name, str(tensor.dtype), tuple(tensor.shape), data)
        sink(name, tensor)

    def own() -> Iterator[tuple[str, torch.Tensor]]:
        """This pipeline stage's tensors: the embedding on the first stage, its layers, the
        final norm and (untied) output layer on the last."""
        embedding = params.get("embedding.word_embeddings.weight")
        if embedding is not None:
            yield (
                "model.embed_tokens.weight",
                _vocab_rows(_gather(embedding, 0, group, size), vocab),
            )
        for i, layer in enumerate(inner.decoder.layers):
            global_i = layer.layer_number - 1
            yield from _layer_tensors(params, i, global_i, shape, group, size, ep, etp)
        norm = params.get("decoder.final_layernorm.weight")
        if norm is not None:
            yield "model.norm.weight", norm.detach().clone()
        # a tied last stage holds a copy of the embedding as its output layer: not sent
        output = params.get("output_layer.weight")
        if output is not None and not getattr(shape, "tie_word_embeddings", False):
            yield "lm_head.weight", _vocab_rows(_gather(output, 0, group, size), vocab)

    device = next(iter(params.values())).device
    StageRelay(send, device).run(own(), emit, count)
    return StreamReceipt(
        tensors=digest.tensors,
        bytes=digest.bytes,
        layers=shape.num_hidden_layers,
        digest=digest.hexdigest() if send else None,
    )


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
