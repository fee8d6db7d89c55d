"""LoRA on grouped expert linears: one A/B pair per local expert, stacked and padded.

Why: a grouped expert linear (Megatron's `TEColumnParallelGroupedLinear` /
`TERowParallelGroupedLinear`, call shape `forward(x, m_splits) -> (out, bias)` over tokens
sorted by expert) runs all local experts in one grouped GEMM. Its LoRA does the same: A is
[E, r_pad, in] and B is [E, rows_pad, r_pad], with r padded to `rank_multiple` and each
expert's B rows (output features) to `expert_row_multiple`, which keeps every stride a multiple
of 16 bytes as the grouped GEMM kernels require. Padded elements are zero, so the padded
output columns are zero and are sliced off. Both LoRA GEMMs run through the project's
`grouped_gemm` op (CUTLASS on sm_90 bf16, `torch._grouped_mm` elsewhere; it pads K and N
itself), with the base module's `grouped_gemm_backend` when it has one: there is no silent
per-expert loop behind it.

Detection is by protocol (`num_gemms`, `weight0..`, `explicit_expert_comm`), so the site also
serves any module with that call shape; row vs column comes from the class name (or an
`art_lora_kind` attribute). Our `ArtGroupedLinear` (the experts of `ArtGroupedMLP`) stores all
experts in one `weight` [E, in, out] and says so with `art_stacked_weight = True`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from art_megatron_ext.ops import grouped_gemm

from .adapter import LoraAdapter
from .layer_position import group_size_rank, layer_number, local_expert_offset
from .padding import round_up
from .param_sync import finish_slots_param_sync, lora_factors
from .site import LoraSite, SiteInfo, kaiming_a, seeded_generator

GROUPED_COLUMN = "grouped_column"
GROUPED_ROW = "grouped_row"


def _stacked(module: torch.nn.Module) -> bool:
    return getattr(module, "art_stacked_weight", False) is True


def is_grouped_linear(module: torch.nn.Module) -> bool:
    if not isinstance(getattr(module, "num_gemms", None), int):
        return False
    return hasattr(module, "weight0") or _stacked(module)


def grouped_weight(module: torch.nn.Module) -> torch.Tensor:
    """The parameter that carries dtype, device and the expert `allreduce` flag."""
    return module.weight if _stacked(module) else module.weight0


def grouped_local_out_in(module: torch.nn.Module) -> tuple[int, int]:
    """(out, in) of one expert on this rank: TE's `weight0` is [out, in], a stacked weight
    [E, in, out]."""
    if _stacked(module):
        _, fan_in, fan_out = module.weight.shape
        return int(fan_out), int(fan_in)
    out_local, in_local = module.weight0.shape
    return int(out_local), int(in_local)


def _grouped_kind(module: torch.nn.Module) -> str:
    kind = getattr(module, "art_lora_kind", None)
    if kind is None:
        name = type(module).__name__
        kind = "row" if "Row" in name else "column" if "Column" in name else None
    if kind not in ("row", "column"):
        raise TypeError(
            f"cannot tell whether grouped linear {type(module).__name__} is row- or "
            "column-parallel; set `art_lora_kind` to 'row' or 'column' on it"
        )
    return GROUPED_ROW if kind == "row" else GROUPED_COLUMN


def describe_grouped_linear(path: str, module, modules) -> SiteInfo:
    tp_group = getattr(module, "tp_group", None) or getattr(module, "_tp_group", None)
    tp_size, tp_rank = group_size_rank(tp_group)
    module.tp_group = tp_group
    out_local, in_local = grouped_local_out_in(module)
    kind = _grouped_kind(module)
    column = kind == GROUPED_COLUMN
    experts = modules[path.rsplit(".", 1)[0]] if "." in path else module
    first_expert = local_expert_offset(experts) if hasattr(experts, "num_local_experts") else 0
    target = path.rsplit(".", 1)[-1]
    return SiteInfo(
        path=path,
        target=target,
        kind=kind,
        in_features=in_local if column else in_local * tp_size,
        out_features=out_local * tp_size if column else out_local,
        in_local=in_local,
        out_local=out_local,
        tp_size=tp_size,
        tp_rank=tp_rank,
        sequence_parallel=False,
        explicit_expert_comm=bool(getattr(module, "explicit_expert_comm", tp_size > 1)),
        input_is_parallel=True,
        layer_number=layer_number(path, modules),
        expert_index=first_expert,
        gated=bool(getattr(module.config, "gated_linear_unit", False)) and target == "linear_fc1",
        num_local_experts=int(module.num_gemms),
    )


def grouped_linear_ref(x: torch.Tensor, weight: torch.Tensor, m_splits) -> torch.Tensor:
    """x [T, in] by per-expert weight [E, n, in] -> [T, n] (a loop; reference and fallback)."""
    outs = [F.linear(xe, we) for xe, we in zip(torch.split(x, list(m_splits)), weight, strict=True)]
    return torch.cat(outs) if outs else x.new_zeros(0, weight.shape[1])


def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, m_splits, backend: str = "auto"
) -> torch.Tensor:
    """`grouped_linear_ref` as one grouped GEMM: x [T, in] by per-expert weight [E, n, in]
    (the `nn.Linear` layout, used through its transposed view without a copy) -> [T, n].

    Runs the project's `grouped_gemm` op; a backend that cannot take the operands raises
    (naming why) instead of falling back to a loop."""
    return grouped_gemm(x, weight.transpose(-2, -1), m_splits, backend=backend)


def splits_on_device(m_splits, rows: int, groups: int, device) -> torch.Tensor:
    """`m_splits` (tokens per local expert) as one int64 tensor on `device`.

    Why: Megatron hands grouped linears `m_splits` as a host list, and the grouped GEMM op
    turns a list into a device tensor on every call: a host-to-device copy, which waits for
    the stream. A site runs two LoRA GEMMs per forward, so it converts once and hands both the
    tensor. A host list is checked here, on the host (the op checks device counts only inside
    the CUTLASS kernel, and the torch backend not at all)."""
    if torch.is_tensor(m_splits):
        return m_splits.to(device=device, dtype=torch.int64)  # no copy when already there
    counts = [int(c) for c in m_splits]
    if len(counts) != groups or min(counts, default=0) < 0 or sum(counts) != rows:
        raise ValueError(
            f"m_splits {counts} must hold {groups} non-negative token counts (one per local "
            f"expert) summing to the {rows} input rows"
        )
    return torch.tensor(counts, dtype=torch.int64, device=device)


class GroupedLoraSite(LoraSite):
    """LoRA for all local experts of one grouped linear; a slot is one [E, ...] A/B pair."""

    def logical_shapes(self, rank: int):
        i = self.info
        b_out = i.out_local
        return (i.num_local_experts, rank, i.in_local), (i.num_local_experts, b_out, rank)

    def padded_shapes(self, rank: int):
        (e, r, a_in), (_, b_out, _) = self.logical_shapes(rank)
        rp = round_up(r, self.padding.rank_multiple)
        return (e, rp, a_in), (e, round_up(b_out, self.padding.expert_row_multiple), rp)

    def init_a(self, rank: int, seed: int, slot: str) -> torch.Tensor:
        i = self.info
        full_in = i.in_features
        per_expert = []
        for e in range(i.num_local_experts):
            g = seeded_generator(seed, i.stable_key, i.expert_index + e, slot)
            a = kaiming_a(rank, full_in, g)
            if i.kind == GROUPED_ROW:
                a = a[:, i.tp_rank * i.in_local : (i.tp_rank + 1) * i.in_local]
            per_expert.append(a)
        return torch.stack(per_expert)

    def delta(
        self, x: torch.Tensor, adapter: LoraAdapter, m_splits=None, backend: str = "auto"
    ) -> torch.Tensor:
        from megatron.core import tensor_parallel as tp

        a, b = lora_factors(adapter)  # runs the adapter's pre-hooks (Megatron's param sync)
        if self.info.explicit_expert_comm:
            if self.info.kind == GROUPED_COLUMN:
                a = tp.copy_to_tensor_model_parallel_region(a, group=self.tp_group)
            else:
                b = tp.copy_to_tensor_model_parallel_region(b, group=self.tp_group)
        splits = splits_on_device(m_splits, x.shape[0], self.info.num_local_experts, x.device)
        h = grouped_linear(x.to(a.dtype), a, splits, backend) * adapter.scaling
        return grouped_linear(h, b, splits, backend)[:, : self.info.out_local]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """Dist-checkpoint entries: each slot's `[E_local, ...]` A and B as one tensor with a
        global expert axis (this rank's experts start at `expert_index`), the TP-split factor
        (column B rows, row A columns) also split over expert-TP. Replica ids follow
        Megatron's grouped expert weights: (0, expert-TP rank for the replicated factor else 0,
        expert-DP rank).

        A column site's B is saved without its row padding (which depends on the expert-TP
        size) and, for a gated FC1, as its gate and up halves (each rank holds [gate shard;
        up shard]; the checkpoint holds [all gate; all up], as Megatron's swiglu factory
        does for the FC1 weight). So a checkpoint reloads at any expert-parallel and
        expert-TP size with the same rank padding. The slots' pending Megatron parameter
        all-gather is finished first (see `param_sync`)."""
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        finish_slots_param_sync(self.slots.values())  # a step's all-gather may be pending
        i = self.info
        prepend = len(sharded_offsets)
        column = i.kind == GROUPED_COLUMN
        split, split_axis = ("b", 1) if column else ("a", 2)
        ep_size, edp_rank = 1, 0
        if parallel_state.model_parallel_is_initialized():
            ep_size = parallel_state.get_expert_model_parallel_world_size()
            edp_rank = parallel_state.get_expert_data_parallel_rank()
        expert_axis = (prepend, i.expert_index // i.num_local_experts, ep_size)
        entries = {}
        for name, adapter in self.slots.items():
            for factor, tensor in (("a", adapter.a), ("b", adapter.b)):
                key = f"{prefix}slots.{name}.{factor}"
                offsets = [expert_axis]
                tp_replica = i.tp_rank
                if factor == split:
                    tp_replica = 0
                    if column:
                        tensor = tensor[:, : i.out_local]  # the logical rows
                        if i.gated:
                            entries[key] = _gated_rows_factory(
                                key, tensor, sharded_offsets, expert_axis, i, (0, 0, edp_rank)
                            )
                            continue
                    offsets.append((prepend + split_axis, i.tp_rank, i.tp_size))
                entries[key] = ShardedTensor.from_rank_offsets(
                    key,
                    tensor,
                    *sharded_offsets,
                    *offsets,
                    replica_id=(0, tp_replica, edp_rank),
                    prepend_axis_num=prepend,
                )
        return entries

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """A column B loaded from a dist checkpoint has the logical rows only (see
        `sharded_state_dict`); pad it with zero rows to this rank's padded shape."""
        if self.info.kind == GROUPED_COLUMN:
            for name, adapter in self.slots.items():
                key = f"{prefix}slots.{name}.b"
                value = state_dict.get(key)
                padded = adapter.b.shape
                logical = isinstance(value, torch.Tensor) and value.dim() == 3
                if logical and value.shape[1] == self.info.out_local < padded[1]:
                    full = value.new_zeros(value.shape[0], padded[1], value.shape[2])
                    full[:, : value.shape[1]] = value
                    state_dict[key] = full
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def hook(self, module, args, kwargs, output):
        adapter = self.active_adapter()
        if adapter is None:
            return output
        x = args[0] if args else kwargs["inp"]
        m_splits = args[1] if len(args) > 1 else kwargs["m_splits"]
        out, bias = output
        backend = getattr(module, "grouped_gemm_backend", "auto")
        return out + self.delta(x, adapter, m_splits, backend).to(out.dtype), bias


def _gated_rows_factory(key, tensor, sharded_offsets, expert_axis, info: SiteInfo, replica_id):
    """A gated FC1's B `[E, gate_local + up_local, r]` as two shards of one global
    `[E, gate + up, r]`: this rank's gate rows at fragment `tp_rank`, its up rows at
    `tp_rank + tp_size` of `2 * tp_size` (the layout of Megatron's `apply_swiglu_sharded_factory`
    for the FC1 weight, on the row axis after the expert axis)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    prepend = len(sharded_offsets)
    rows_axis = prepend + 1

    @torch.no_grad()
    def build(key, t, replica_id, flattened_range):
        gate, up = torch.chunk(t, 2, dim=1)
        return [
            ShardedTensor.from_rank_offsets(
                key,
                half,
                *sharded_offsets,
                expert_axis,
                (rows_axis, fragment, 2 * info.tp_size),
                replica_id=replica_id,
                prepend_axis_num=prepend,
            )
            for half, fragment in ((gate, info.tp_rank), (up, info.tp_rank + info.tp_size))
        ]

    @torch.no_grad()
    def merge(parts):
        return torch.cat(parts, dim=1)

    return ShardedTensorFactory(key, tensor, build, merge, replica_id)
