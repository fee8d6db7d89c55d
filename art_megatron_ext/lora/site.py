"""LoRA on one Megatron-core linear, tensor-parallel aware, without copying the linear.

Why a forward hook and a child module instead of a replacement wrapper: the base linear stays
the same object (its class, `weight`, `backward_dw`, state-dict keys and every `isinstance`
check in Megatron keep working), and the LoRA parameters live in `base.lora` (this module).

Tensor parallelism. The A/B shard follows the base layer's split:

| base          | A (r x in)               | B (out x r)              |
| ------------- | ------------------------ | ------------------------ |
| column (QKV, FC1) | replicated           | split on rows like W     |
| row (proj, FC2)   | split on columns like W | replicated            |

and the communication mirrors Megatron's own for the base weight, on the low-rank activation
h = A x (r wide, cheap):
- column: h is summed over TP in backward (`copy_to_tensor_model_parallel_region`), so A's
  gradient and the LoRA part of dX are complete on every rank; with sequence parallelism h is
  all-gathered over the sequence (backward: reduce-scatter) and A is marked
  `sequence_parallel` so Megatron's `finalize_model_grads` all-reduces its gradient over TP.
- row: h is all-reduced in forward (`reduce_from_tensor_model_parallel_region`); with
  sequence parallelism it is reduce-scattered and B is marked `sequence_parallel`.
- expert linears with explicit expert communication (the token dispatcher gathers inputs and
  sums outputs over expert-TP): no communication on activations; the replicated factor's
  gradient is summed over expert-TP (`copy_to_tensor_model_parallel_region` on the factor).
Replicated factors get `tensor_model_parallel=False`, split ones the base's partition dim,
and expert factors copy the base weight's `allreduce` flag (expert-DP reduction).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .active_slot import NO_CHOICE, current_choice
from .adapter import LoraAdapter
from .config import DEFAULT_SLOT, LoraPadding
from .padding import round_up
from .param_sync import finish_slots_param_sync, lora_factors

COLUMN = "column"
ROW = "row"


class SlotHasLiveGradients(RuntimeError):
    """Loading into a slot whose parameters still hold gradients of an unfinished step."""


class NoActiveSlot(RuntimeError):
    """A forward ran without `activate_slot` at a site that has no default slot."""


@dataclass(frozen=True)
class SiteInfo:
    """Where a LoRA site sits and how its base linear is split.

    Shapes: `in_features`/`out_features` are the full (unsharded) base shape; `*_local` this
    rank's. `layer_number` is the 1-based global GPT layer (Megatron's `layer_number`; in a
    `HybridModel` the GPT layer its attention/MLP pair forms, `layer_position`; None outside
    layers); `expert_index` the global expert index for expert linears.
    """

    path: str
    target: str
    kind: str
    in_features: int
    out_features: int
    in_local: int
    out_local: int
    tp_size: int
    tp_rank: int
    sequence_parallel: bool
    explicit_expert_comm: bool
    input_is_parallel: bool
    layer_number: int | None = None
    expert_index: int | None = None
    gated: bool = False
    in_shared_experts: bool = False
    num_local_experts: int | None = None  # grouped sites: experts held by this rank
    qkv_layout: tuple[int, int, int] | None = None  # (query groups, q heads/group, head dim)
    layernorm_input: bool = False  # TE layernorm-fused linear: LoRA reads its normalized input

    @property
    def stable_key(self) -> str:
        """Names the site independently of pipeline stage and parallel sizes (init seeds)."""
        if self.layer_number is None:
            return self.path
        shared = "shared_experts/" if self.in_shared_experts else ""
        expert = "" if self.expert_index is None else f"/expert{self.expert_index}"
        return f"layer{self.layer_number}/{shared}{self.target}{expert}"


def kaiming_a(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """PEFT's A init (kaiming-uniform, a=sqrt(5)): U(-1/sqrt(cols), 1/sqrt(cols))."""
    bound = 1.0 / math.sqrt(cols)
    return (torch.rand(rows, cols, generator=generator, dtype=torch.float64) * 2 - 1) * bound


def seeded_generator(seed: int, *key: Any) -> torch.Generator:
    text = "/".join(str(k) for k in key)
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(text.encode())) % 2**63)


class LoraSite(torch.nn.Module):
    """The slots of one Megatron linear and the hook that adds the active slot's delta."""

    def __init__(self, info: SiteInfo, tp_group: Any, padding: LoraPadding, dtype, device):
        super().__init__()
        self.info = info
        self.tp_group = tp_group
        self.padding = padding
        self.dtype = dtype
        self.device = device
        self.slots = torch.nn.ModuleDict()
        self.replicated_allreduce = True  # Megatron's `allreduce` flag copied from the base
        self.hook_handle = None  # set by attach_lora

    # ---- shapes --------------------------------------------------------------------------
    def logical_shapes(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(A, B) local logical shapes for `rank`."""
        i = self.info
        a_in = i.in_features if i.kind == COLUMN else i.in_local
        b_out = i.out_local if i.kind == COLUMN else i.out_features
        return (rank, a_in), (b_out, rank)

    def padded_shapes(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        (r, a_in), (b_out, _) = self.logical_shapes(rank)
        rp = round_up(r, self.padding.rank_multiple)
        return (rp, a_in), (b_out, rp)

    # ---- slot management -----------------------------------------------------------------
    def init_a(self, rank: int, seed: int, slot: str) -> torch.Tensor:
        """A drawn on the full logical shape, then this rank's shard (TP-size invariant)."""
        i = self.info
        g = seeded_generator(seed, i.stable_key, slot)
        full = kaiming_a(rank, i.in_features, g)
        if i.kind == ROW:
            full = full[:, i.tp_rank * i.in_local : (i.tp_rank + 1) * i.in_local]
        return full

    def add_slot(self, name: str, rank: int, alpha: float, seed: int = 0) -> LoraAdapter:
        """A fresh trainable slot: PEFT-style A, zero B (so the model is unchanged)."""
        a = self.init_a(rank, seed, name)
        b = torch.zeros(self.logical_shapes(rank)[1], dtype=torch.float64)
        return self.load_slot(name, a, b, alpha)

    def load_slot(
        self, name: str, a: torch.Tensor, b: torch.Tensor, alpha: float, parts: int = 1
    ) -> LoraAdapter:
        """Put local logical `a`/`b` into slot `name` (created, or overwritten in place).

        `parts` > 1: `a` stacks one A per fused part and `b` is block-diagonal (see
        `LoraAdapter`); its off-block entries must be 0. Overwriting keeps the same Parameter
        objects when the shapes are unchanged, so an optimizer holding them keeps working; a
        frozen slot (see `slot_training`) stays frozen either way. Raises
        `SlotHasLiveGradients` if the slot still holds gradients (the slot is left as it was).
        """
        stacked = int(a.shape[-2])
        want_a, want_b = self.logical_shapes(stacked)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b or stacked % parts:
            raise ValueError(
                f"LoRA site {self.info.path}: slot {name!r} needs local A {want_a} and B {want_b}"
                f" for stacked rank {stacked} ({parts} part(s)), got A {tuple(a.shape)} and "
                f"B {tuple(b.shape)}"
            )
        old = self.slots[name] if name in self.slots else None  # noqa: SIM401 (no ModuleDict.get)
        if old is not None and old.holds_live_gradients():
            raise SlotHasLiveGradients(
                f"LoRA site {self.info.path}: slot {name!r} still holds gradients; finish the "
                "step (optimizer.step() then zero_grad(set_to_none=True)) before loading into "
                "it. The slot keeps its current weights."
            )
        rank = stacked // parts
        mask = self.block_zero_mask(rank, parts) if parts > 1 else None
        if mask is not None and b.ne(0).logical_and(mask[tuple(map(slice, b.shape[-2:]))]).any():
            raise ValueError(
                f"LoRA site {self.info.path}: B of slot {name!r} is not block-diagonal"
            )
        a = a.to(device=self.device, dtype=self.dtype)
        b = b.to(device=self.device, dtype=self.dtype)
        if old is not None and (old.rank, old.parts) == (rank, parts):
            with torch.no_grad():
                old.a.zero_()
                old.b.zero_()
                old.a[tuple(slice(0, s) for s in want_a)] = a
                old.b[tuple(slice(0, s) for s in want_b)] = b
            old.alpha = float(alpha)
            return old
        pa, pb = self.padded_shapes(stacked)
        adapter = LoraAdapter(
            a, b, rank=rank, alpha=alpha, a_padded=pa, b_padded=pb, parts=parts, b_zero_mask=mask
        )
        if old is not None and not old.a.requires_grad:  # a frozen slot stays frozen
            adapter.a.requires_grad_(False)
            adapter.b.requires_grad_(False)
        self._tag_parallel_attributes(adapter)
        self.slots[name] = adapter
        return adapter

    def block_zero_mask(self, rank: int, parts: int) -> torch.Tensor:
        """[rows_pad, r_pad] True where B must be 0 for a slot with `parts` stacked A blocks."""
        from .hf_layout import local_row_parts

        row_part = local_row_parts(self.info)
        if int(row_part.max()) + 1 != parts:
            raise ValueError(
                f"LoRA site {self.info.path} has {int(row_part.max()) + 1} fused parts, not {parts}"
            )
        (_, b_padded) = self.padded_shapes(rank * parts)
        rows_pad, rank_pad = b_padded[-2:]
        mask = torch.zeros(rows_pad, rank_pad, dtype=torch.bool)
        col_part = torch.arange(rank * parts) // rank
        mask[: row_part.numel(), : rank * parts] = row_part[:, None] != col_part[None, :]
        return mask

    def drop_slot(self, name: str) -> None:
        if name not in self.slots:
            raise KeyError(f"LoRA site {self.info.path} has no slot {name!r}")
        del self.slots[name]

    def _tag_parallel_attributes(self, adapter: LoraAdapter) -> None:
        i = self.info
        column = i.kind.endswith(COLUMN)
        split, replicated = (adapter.b, adapter.a) if column else (adapter.a, adapter.b)
        split_dim = split.dim() - 2 if column else split.dim() - 1
        split.tensor_model_parallel, split.partition_dim, split.partition_stride = (
            i.tp_size > 1,
            split_dim,
            1,
        )
        replicated.tensor_model_parallel = False
        replicated.partition_dim, replicated.partition_stride = -1, 1
        if i.sequence_parallel and not i.explicit_expert_comm:
            replicated.sequence_parallel = True
        for p in (adapter.a, adapter.b):
            p.allreduce = self.replicated_allreduce

    # ---- Megatron distributed checkpointing ----------------------------------------------
    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """Dist-checkpoint entries: the TP-split factor sharded on the base weight's axis, the
        replicated one replicated (Megatron's `make_sharded_tensors_for_checkpoint`), after
        the slots' pending Megatron parameter all-gather (see `param_sync`); a gated
        FC1's B split into its gate and up halves like the FC1 weight, so the checkpoint holds
        [gate; up] in full and reloads at another TP size."""
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        finish_slots_param_sync(self.slots.values())  # a step's all-gather may be pending
        column = self.info.kind == COLUMN
        split, axis = ("b", 0) if column else ("a", 1)
        axis_map = {f"slots.{name}.{split}": axis for name in self.slots}
        dp_cp_group = (metadata or {}).get("dp_cp_group")
        if dp_cp_group is None:
            dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        state = self.state_dict(prefix="", keep_vars=True)
        entries = make_sharded_tensors_for_checkpoint(
            state,
            prefix,
            axis_map,
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=dp_cp_group,
        )
        if self.info.gated:  # B rows are [gate shard; up shard] per rank, as the FC1 weight
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            singleton = bool((metadata or {}).get("singleton_local_shards", False))
            for name in self.slots:
                key = f"{prefix}slots.{name}.b"
                entries[key] = apply_swiglu_sharded_factory(
                    entries[key],
                    sharded_offsets,
                    singleton,
                    tp_group=self.tp_group,
                    dp_group=dp_cp_group,
                )
        return entries

    # ---- forward -------------------------------------------------------------------------
    def active_adapter(self) -> LoraAdapter | None:
        choice = current_choice()
        if choice is NO_CHOICE:
            if DEFAULT_SLOT in self.slots:
                return self.slots[DEFAULT_SLOT]
            if len(self.slots):
                raise NoActiveSlot(
                    f"LoRA site {self.info.path} holds slots {sorted(self.slots)} but no "
                    f"{DEFAULT_SLOT!r} slot; choose one with activate_slot(model, name)"
                )
            return None
        if choice is None or choice not in self.slots:
            return None
        return self.slots[choice]

    def delta(self, x: torch.Tensor, adapter: LoraAdapter) -> torch.Tensor:
        """The LoRA output of `adapter` for the base input `x`, shaped like the base output."""
        from megatron.core import tensor_parallel as tp

        i, g = self.info, self.tp_group
        a, b = lora_factors(adapter)  # runs the adapter's pre-hooks (Megatron's param sync)
        x = x.to(a.dtype)
        if i.kind == COLUMN:
            if i.explicit_expert_comm:
                h = F.linear(x, tp.copy_to_tensor_model_parallel_region(a, group=g))
            elif i.sequence_parallel:
                h = tp.gather_from_sequence_parallel_region(F.linear(x, a), group=g)
            else:
                h = tp.copy_to_tensor_model_parallel_region(F.linear(x, a), group=g)
            return F.linear(h * adapter.scaling, b)
        if not i.input_is_parallel:
            x = tp.scatter_to_tensor_model_parallel_region(x, group=g)
        h = F.linear(x, a)
        if i.explicit_expert_comm:
            return F.linear(h * adapter.scaling, tp.copy_to_tensor_model_parallel_region(b, g))
        if i.sequence_parallel:
            h = tp.reduce_scatter_to_sequence_parallel_region(h, group=g)
        else:
            h = tp.reduce_from_tensor_model_parallel_region(h, group=g)
        return F.linear(h * adapter.scaling, b)

    def hook(self, module, args, kwargs, output):
        """Forward hook on the base linear: add the active slot's delta to its output.

        A layernorm-fused TE linear was switched to also return its normalized input
        (`return_layernorm_output`); LoRA takes it as x, as PEFT's LoRA on an HF model sees
        the output of the separate norm, and the hook returns the usual `(out, bias)`."""
        if self.info.layernorm_input:
            from .. import compat

            out, bias, x = compat.te_layernorm_output(output)
            output = (out, bias)
        else:
            x = args[0] if args else kwargs.get("input_", kwargs.get("x"))
        adapter = self.active_adapter()
        if adapter is None:
            return output
        out, bias = output
        return out + self.delta(x, adapter).to(out.dtype), bias

    def extra_repr(self) -> str:
        i = self.info
        return f"{i.path}: {i.kind}, tp={i.tp_size}, slots={list(self.slots)}"
