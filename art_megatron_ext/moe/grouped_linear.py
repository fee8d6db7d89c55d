"""`ArtGroupedLinear`: the linears of all local experts as one grouped GEMM (a LoRA site).

Why a module per linear (and not two bare parameters on the MLP): LoRA, export and checkpoint
code find expert linears by name (`linear_fc1`, `linear_fc2`) and call shape, as they find
Transformer Engine's grouped linears. This module has that shape, `forward(x, m_splits) ->
(out, None)` over rows sorted by expert, plus `num_gemms` and a stacked `weight`
[L, in, out] (the layout `grouped_gemm` takes, flagged by `art_stacked_weight`), so
`attach_lora` turns it into a grouped LoRA site (art_megatron_ext/lora/grouped.py).

Dist checkpoint (`sharded_state_dict`): the stacked weight is saved in Megatron's layout for
expert linears, that of `SequentialMLP` and `TEGroupedMLP`: one [out, in] tensor per local
expert at global expert index `ep_rank * L + e` of `L * ep_size`, a gated FC1 as its gate and
up halves, replicated over the expert-data-parallel group. So a checkpoint reloads at another
expert-parallel size, and Megatron's expert checkpoints load into it (legacy `GroupedMLP`, with
our input-major layout, did the same). Saving makes a transposed copy of each expert weight.
"""

from __future__ import annotations

import torch

from art_megatron_ext.ops import grouped_gemm


class ArtGroupedLinear(torch.nn.Module):
    """`out[rows of e] = x[rows of e] @ weight[e]` for every local expert e, bias-free.

    Args:
        num_local_experts: L.
        in_features, out_features: per-expert shape (expert tensor parallelism is 1).
        kind: "column" (fc1: its LoRA B is split like the output) or "row" (fc2).
        config: Megatron `TransformerConfig` (dtype, device, gated_linear_unit: a column
            linear's output columns are then [gate; up]).
        backend: `grouped_gemm` backend ("auto", "cutlass", "torch").
        ep_group, expt_dp_group: expert-parallel and expert-data-parallel groups (Megatron's
            `pg_collection.ep` / `.expt_dp`); None: Megatron's global parallel state, or a
            single rank when it is not initialized. Only `sharded_state_dict` reads them.
    """

    art_stacked_weight = True

    def __init__(
        self,
        num_local_experts: int,
        in_features: int,
        out_features: int,
        *,
        kind: str,
        config,
        backend: str = "auto",
        ep_group=None,
        expt_dp_group=None,
    ) -> None:
        super().__init__()
        if kind not in ("column", "row"):
            raise ValueError(f"ArtGroupedLinear kind must be 'column' or 'row', got {kind!r}")
        self.num_gemms = num_local_experts
        self.config = config
        self.art_lora_kind = kind
        self.grouped_gemm_backend = backend
        self.tp_group = None  # expert tensor parallel size 1
        self.explicit_expert_comm = False  # nothing to communicate inside the experts
        self.ep_group = ep_group
        self.expt_dp_group = expt_dp_group
        self.gated_rows = kind == "column" and bool(config.gated_linear_unit)
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(
            torch.empty(
                num_local_experts, in_features, out_features, dtype=config.params_dtype,
                device=device,
            )
        )  # fmt: skip
        self.weight.allreduce = False  # expert parameters: reduced over the expert-DP group

    @torch.no_grad()
    def init_like_megatron(self, init_method) -> None:
        """Each expert initialized as Megatron initializes an [out, in] linear weight."""
        for e in range(self.num_gemms):
            w = torch.empty(self.weight.shape[2], self.weight.shape[1], dtype=torch.float32)
            init_method(w)
            self.weight[e].copy_(w.t())

    def forward(self, x: torch.Tensor, m_splits) -> tuple[torch.Tensor, None]:
        """Under `config.gradient_accumulation_fusion` the weight gradient goes into the
        weight's fp32 `main_grad` (Megatron's DDP buffer), as Megatron's grouped experts do."""
        fused = getattr(self.config, "gradient_accumulation_fusion", False)
        out = grouped_gemm(
            x, self.weight, m_splits, backend=self.grouped_gemm_backend,
            main_grad_param=self.weight if fused else None,
        )  # fmt: skip
        return out, None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """Dist-checkpoint entries: `{prefix}weight` as a factory of per-expert [out, in]
        ShardedTensors in Megatron's expert layout (module docstring), then the children's own
        entries (a LoRA site: `{prefix}lora.*`). `ArtGroupedMLP` renames the keys to Megatron's
        `experts.<linear>.` form. The factory's data is the parameter itself: Megatron maps
        optimizer state to model entries by the identity of `data`."""
        from megatron.core.transformer.utils import sharded_state_dict_default

        if (metadata or {}).get("singleton_local_shards", False):
            raise NotImplementedError(
                f"{type(self).__name__} at '{prefix}': sharded_state_dict metadata "
                "singleton_local_shards=True (one key per expert) is not supported; use the "
                "default (False), which saves the same weights under Megatron's expert keys. "
                "Nothing was built."
            )
        first, total, edp_rank = self._expert_layout()
        entries = {
            f"{prefix}weight": _expert_weight_factory(
                f"{prefix}weight",
                self.weight,
                sharded_offsets,
                first_expert=first,
                num_experts=total,
                gated_rows=self.gated_rows,
                replica_id=(0, 0, edp_rank),
            )
        }
        for name, child in self.named_children():
            entries.update(
                sharded_state_dict_default(child, f"{prefix}{name}.", sharded_offsets, metadata)
            )
        return entries

    def _expert_layout(self) -> tuple[int, int, int]:
        """(global index of local expert 0, global expert count, expert-DP rank)."""
        from megatron.core import parallel_state

        ep_size, ep_rank, edp_rank = 1, 0, 0
        initialized = parallel_state.model_parallel_is_initialized()
        if self.ep_group is not None:
            ep_size, ep_rank = self.ep_group.size(), self.ep_group.rank()
        elif initialized:
            ep_size = parallel_state.get_expert_model_parallel_world_size()
            ep_rank = parallel_state.get_expert_model_parallel_rank()
        if self.expt_dp_group is not None:
            edp_rank = self.expt_dp_group.rank()
        elif initialized:
            edp_rank = parallel_state.get_expert_data_parallel_rank(with_gtp_remat=False)
        return ep_rank * self.num_gemms, ep_size * self.num_gemms, edp_rank

    def extra_repr(self) -> str:
        experts, fan_in, fan_out = self.weight.shape
        return f"experts={experts}, in={fan_in}, out={fan_out}, kind={self.art_lora_kind}"


def _expert_weight_factory(
    key: str,
    weight: torch.Tensor,
    sharded_offsets,
    *,
    first_expert: int,
    num_experts: int,
    gated_rows: bool,
    replica_id,
):
    """A stacked [L, in, out] weight as Megatron's per-expert checkpoint tensors.

    Local expert e is the [out, in] tensor (`weight[e].t()`) at index `first_expert + e` of a
    prepended expert axis of `num_experts`; with `gated_rows` its gate and up rows are
    fragments 0 and 1 of 2 on the row axis (Megatron's `apply_swiglu_sharded_factory` at
    expert-TP 1). Loading stacks the transposes back."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    prepend = len(sharded_offsets)
    halves = 2 if gated_rows else 1

    @torch.no_grad()
    def build(key, t, replica_id, flattened_range):
        if flattened_range is not None:
            raise NotImplementedError(
                f"{key}: a flattened range of a grouped expert weight is not supported "
                "(megatron-core 0.19 saves unflattened ShardedTensors)"
            )
        shards = []
        for e in range(t.shape[0]):
            expert_axis = (prepend, first_expert + e, num_experts)
            for part, rows in enumerate(torch.chunk(t[e].t(), halves, dim=0)):
                row_axis = ((prepend + 1, part, halves),) if gated_rows else ()
                shards.append(
                    ShardedTensor.from_rank_offsets(
                        key,
                        rows,
                        *sharded_offsets,
                        expert_axis,
                        *row_axis,
                        replica_id=replica_id,
                        prepend_axis_num=prepend + 1,
                    )
                )
        return shards

    @torch.no_grad()
    def merge(parts):
        experts = [torch.cat(parts[i : i + halves]) for i in range(0, len(parts), halves)]
        return torch.stack([w.t() for w in experts])

    return ShardedTensorFactory(key, weight, build, merge, replica_id)
