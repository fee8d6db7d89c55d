"""Megatron fused layouts <-> Hugging Face module names and tensors (pure tensor math).

Why a module of its own: the layouts are the part most easily got wrong and are testable
without Megatron.
- QKV: Megatron's fused `linear_qkv` rows are interleaved per query group,
  `[q heads of group 0, k0, v0 | q heads of group 1, k1, v1 | ...]` (each head `head_dim`
  rows), and a tensor-parallel rank holds whole consecutive groups. HF keeps q/k/v apart.
- FC1 with a gated linear unit: each tensor-parallel rank holds `[gate shard; up shard]`
  (Megatron's GLU chunks the local output in two, gate first), so the full tensor is
  `[g0; u0; g1; u1; ...]`, not `[gate; up]`.
Only B (the output side) is fused; the fused parts share one A.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

PEFT_PREFIX = "base_model.model."  # PEFT's key prefix for a causal LM's modules


@dataclass(frozen=True)
class HfNaming:
    """Hugging Face module paths of a Llama/Qwen-style causal LM (format fields in braces)."""

    layer: str = "model.layers.{layer}"
    q: str = "self_attn.q_proj"
    k: str = "self_attn.k_proj"
    v: str = "self_attn.v_proj"
    o: str = "self_attn.o_proj"
    gate: str = "mlp.gate_proj"
    up: str = "mlp.up_proj"
    down: str = "mlp.down_proj"
    expert: str = "mlp.experts.{expert}"
    shared_experts: str = "mlp.shared_experts"
    expert_gate: str = "gate_proj"
    expert_up: str = "up_proj"
    expert_down: str = "down_proj"


def hf_modules(info, naming: HfNaming | None = None, expert: int | None = None) -> list[str]:
    """HF module paths (in fused order) that the Megatron site `info` stands for."""
    naming = naming or HfNaming()
    if info.layer_number is None:
        raise ValueError(f"LoRA site {info.path} is not inside a transformer layer")
    layer = naming.layer.format(layer=info.layer_number - 1)
    target = info.target
    if target == "linear_qkv":
        return [f"{layer}.{naming.q}", f"{layer}.{naming.k}", f"{layer}.{naming.v}"]
    if target == "linear_proj":
        return [f"{layer}.{naming.o}"]
    expert = info.expert_index if expert is None else expert
    if expert is not None and not info.in_shared_experts:
        base = f"{layer}.{naming.expert.format(expert=expert)}"
        gate, up, down = naming.expert_gate, naming.expert_up, naming.expert_down
    elif info.in_shared_experts:
        base = f"{layer}.{naming.shared_experts}"
        gate, up, down = naming.expert_gate, naming.expert_up, naming.expert_down
    else:
        base = layer
        gate, up, down = naming.gate, naming.up, naming.down
    if target == "linear_fc1":
        if not info.gated:
            raise ValueError(f"LoRA site {info.path}: a non-gated FC1 has no Llama-style name")
        return [f"{base}.{gate}", f"{base}.{up}"]
    if target == "linear_fc2":
        return [f"{base}.{down}"]
    raise ValueError(f"LoRA site {info.path}: unknown target {target!r}")


def split_fused_b(info, shards: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-rank local B shards (TP order) -> full B of each HF module, in `hf_modules` order."""
    if info.target == "linear_qkv":
        groups, q_per_group, head_dim = info.qkv_layout
        full = torch.cat(shards, dim=0)
        rank = full.shape[-1]
        per_group = full.reshape(groups, q_per_group + 2, head_dim, rank)
        q = per_group[:, :q_per_group].reshape(groups * q_per_group * head_dim, rank)
        k = per_group[:, q_per_group].reshape(groups * head_dim, rank)
        v = per_group[:, q_per_group + 1].reshape(groups * head_dim, rank)
        return [q, k, v]
    if info.target == "linear_fc1" and info.gated:
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    return [torch.cat(shards, dim=0)]


def fuse_b_shard(info, parts: list[torch.Tensor], tp_rank: int, tp_size: int) -> torch.Tensor:
    """Inverse of `split_fused_b` for one rank: full B of each HF module -> local fused B."""
    if info.target == "linear_qkv":
        groups, q_per_group, head_dim = info.qkv_layout
        q, k, v = parts
        rank = q.shape[-1]
        fused = torch.cat(
            [
                q.reshape(groups, q_per_group, head_dim, rank),
                k.reshape(groups, 1, head_dim, rank),
                v.reshape(groups, 1, head_dim, rank),
            ],
            dim=1,
        ).reshape(-1, rank)
        return fused.chunk(tp_size, dim=0)[tp_rank]
    if info.target == "linear_fc1" and info.gated:
        gate, up = parts
        return torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]])
    (single,) = parts
    return single.chunk(tp_size, dim=0)[tp_rank]


def local_row_parts(info) -> torch.Tensor:
    """For each row of this rank's fused B (per expert for grouped sites), the index of the HF
    module (in `hf_modules` order) it belongs to."""
    if info.target == "linear_qkv":
        groups, q_per_group, head_dim = info.qkv_layout
        per_group = torch.tensor([0] * q_per_group + [1, 2]).repeat_interleave(head_dim)
        return per_group.repeat(groups // info.tp_size)
    if info.target == "linear_fc1" and info.gated:
        return torch.arange(2).repeat_interleave(info.out_local // 2)
    return torch.zeros(info.out_local, dtype=torch.long)


def fused_qkv(shape) -> SimpleNamespace:
    """The layout `split_fused_b` / `fuse_b_shard` need for a whole `linear_qkv` weight of a
    model of `shape` (a `GptShape` or `MoeShape`): query groups, queries per group, head dim."""
    return SimpleNamespace(
        target="linear_qkv",
        gated=False,
        qkv_layout=(
            shape.num_key_value_heads,
            shape.num_attention_heads // shape.num_key_value_heads,
            shape.head_dim,
        ),
    )


FUSED_GATE_UP = SimpleNamespace(target="linear_fc1", gated=True, qkv_layout=None)
"""The layout of a whole gated `linear_fc1` weight: per TP rank `[gate; up]`."""
