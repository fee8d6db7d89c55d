"""A CPU stand-in for Megatron-core 0.19's Transformer Engine linear wrappers (tests only).

Why: Transformer Engine needs CUDA (it does not even install against a CPU torch; see
../shared/docs/megatron-and-cuda-here.md), but the LoRA extension must attach to the linears
Megatron's TE specs build. These classes were written from
`megatron/core/extensions/transformer_engine.py` (megatron-core 0.19.2) and the parts of
`transformer_engine.pytorch.{Linear, LayerNormLinear, GroupedLinear}` that the wrappers
rely on. The extension never imports them: it recognizes TE linears by class name and
attributes (art_megatron_ext/compat.py), which these reproduce.

What they reproduce:
- Class names and hierarchy: `TELinear` <- `TEColumnParallelLinear`, `TERowParallelLinear`;
  `TELayerNormColumnParallelLinear` (not a `TELinear`, as in Megatron); `TEGroupedLinear`
  <- `TEColumnParallelGroupedLinear`, `TERowParallelGroupedLinear`. Constructor signatures
  are the wrappers' (the keyword arguments Megatron's modules pass).
- Attributes: `parallel_mode` as handed to TE ("column"/"row", None for the duplicated mode and
  for expert linears whose communication the token dispatcher does, `explicit_expert_comm`),
  `te_return_bias`, `return_bias`, `use_bias`, `sequence_parallel` (TP > 1 and the config's),
  `tp_size`, `tp_group` (TE's, None when TE does no communication) and `_tp_group`
  (Megatron's), `in_features`/`out_features` per partition, `weight` ([out, in] local shard)
  or `weight0..` / `bias0..` (grouped), `num_gemms`, `explicit_expert_comm` (grouped),
  `config`; for the layernorm-fused linear `layer_norm_weight` (`layer_norm_bias` for
  LayerNorm), `normalization`, `eps`, `zero_centered_gamma`, `return_layernorm_output`,
  `return_layernorm_output_gathered`. Parameter marks (`tensor_model_parallel`,
  `partition_dim`, `allreduce`, `sequence_parallel` on the norm weight, Megatron's own
  `_set_expert_parameter_attributes` for expert linears).
- Forward contract: TE's module returns `out`, `(out, bias)` with `return_bias`, and the
  layernorm-fused one `(out, ln_out)` / `(out, bias, ln_out)` with `return_layernorm_output`
  (ln_out = the normalized local input, before the sequence-parallel gather; the gathered one
  with `return_layernorm_output_gathered`); the wrapper returns TE's tuple as is when
  `te_return_bias`, else `(TE's output, None)`. Grouped: `forward(x, m_splits)`, biases of
  `return_bias` as a list per GEMM. TP communication is TE's: column all-gathers a
  sequence-parallel input (else identity forward, all-reduce backward), row all-reduces or
  reduce-scatters (sequence parallel); none when `parallel_mode` is None.
- `sharded_state_dict`: the wrappers' axis maps (column weight/bias on axis 0, row weight on
  axis 1, grouped per GEMM with the expert offset, as `_sharded_state_dict_grouped`).

What they do not reproduce: FP8/FP4 (quantized weights, `fp8_autocast`, `_extra_state` and
its sharded objects), fused kernels and userbuffer overlap, `delay_wgrad_compute` /
`backward_dw`, `fuse_wgrad_accumulation` (`main_grad` is left to DDP), GTP remat,
`single_grouped_weight`, `TEDotProductAttention`, `TENorm` and the op fuser (the stand-in spec
uses Megatron's local attention and a torch norm). Numerics are plain fp32/bf16 torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [  # noqa: F822 (StandinSpecProvider is built lazily by the module __getattr__)
    "StandinSpecProvider",
    "TEColumnParallelGroupedLinear",
    "TEColumnParallelLinear",
    "TEGroupedLinear",
    "TELayerNormColumnParallelLinear",
    "TELinear",
    "TERowParallelGroupedLinear",
    "TERowParallelLinear",
    "te_standin_layer_spec",
]


def _pg_size_rank(group) -> tuple[int, int]:
    if group is None or not torch.distributed.is_initialized():
        return 1, 0
    return group.size(), group.rank()


def _tp_group_if_none(tp_group, is_expert: bool):
    from megatron.core.utils import get_tensor_model_parallel_group_if_none

    return get_tensor_model_parallel_group_if_none(tp_group, is_expert=is_expert)


def _init_weight(weight, config, init_method, full_out, full_in, dim, rank, size) -> None:
    """Megatron's CPU initialization of one shard (what the wrappers do on CPU init)."""
    from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu

    per_partition = weight.shape[dim]
    _initialize_affine_weight_cpu(
        weight,
        full_out,
        full_in,
        per_partition,
        dim,
        init_method=init_method,
        stride=1,
        return_master_weight=False,
        rank=rank,
        world_size=size,
        skip_set_tensor_parallel_attributes=True,
    )


def _column_input(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    from megatron.core import tensor_parallel as tp

    if group is None:
        return x
    if sequence_parallel:
        return tp.gather_from_sequence_parallel_region(x, group=group)
    return tp.copy_to_tensor_model_parallel_region(x, group=group)


def _row_output(y: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    from megatron.core import tensor_parallel as tp

    if group is None:
        return y
    if sequence_parallel:
        return tp.reduce_scatter_to_sequence_parallel_region(y, group=group)
    return tp.reduce_from_tensor_model_parallel_region(y, group=group)


def _mark_parallel(param: torch.nn.Parameter, parallel_mode: str | None) -> None:
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    if parallel_mode in ("column", "row"):
        set_tensor_model_parallel_attributes(param, True, 0 if parallel_mode == "column" else 1, 1)


class TELinear(torch.nn.Module):
    """Megatron's `TELinear` (a `te.pytorch.Linear`): see the module docstring."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        parallel_mode: str | None,
        config,
        init_method,
        bias: bool,
        skip_bias_add: bool,
        skip_weight_param_allocation: bool,
        tp_comm_buffer_name: str | None = None,
        is_expert: bool = False,
        symmetric_ar_type: str | None = None,
        tp_group=None,
        name: str | None = None,
        gtp_remat_group=None,
    ) -> None:
        super().__init__()
        if skip_weight_param_allocation:
            raise ValueError(
                "Transformer Engine linear layers do not support skip_weight_param_allocation"
            )
        self.config = config
        self.te_return_bias = skip_bias_add and bias
        self.is_first_microbatch = True
        full_in, full_out = input_size, output_size
        tp_size = 1 if parallel_mode == "duplicated" else _pg_size_rank(tp_group)[0]
        self.expert_parallel = config.expert_model_parallel_size > 1
        use_expert_pgs = is_expert and (
            self.expert_parallel
            or config.expert_tensor_parallel_size != config.tensor_model_parallel_size
        )
        te_parallel_mode, tp_group_for_te = parallel_mode, tp_group
        if parallel_mode == "duplicated":
            tp_group_for_te, te_parallel_mode = None, None
        else:
            explicit_expert_comm = is_expert and (tp_size > 1 or self.expert_parallel)
            if explicit_expert_comm:
                if parallel_mode == "column":
                    output_size //= tp_size
                elif parallel_mode == "row":
                    input_size //= tp_size
                te_parallel_mode, tp_size, tp_group_for_te = None, 1, None
        # te.pytorch.Linear: per-partition features, TE's own parallel attributes
        self.parallel_mode = te_parallel_mode
        self.tp_size = tp_size
        self.tp_group = tp_group_for_te if tp_size > 1 else None
        self.sequence_parallel = tp_size > 1 and bool(config.sequence_parallel)
        self.in_features = input_size // tp_size if te_parallel_mode == "row" else input_size
        self.out_features = output_size // tp_size if te_parallel_mode == "column" else output_size
        self.use_bias = bias
        self.return_bias = self.te_return_bias
        self.weight = torch.nn.Parameter(
            torch.empty(self.out_features, self.in_features, dtype=config.params_dtype)
        )
        _mark_parallel(self.weight, te_parallel_mode)
        if bias:
            self.bias = torch.nn.Parameter(
                torch.zeros(self.out_features, dtype=config.params_dtype)
            )
            if te_parallel_mode == "column":
                _mark_parallel(self.bias, "column")
        else:
            self.bias = None
        dim = 1 if parallel_mode == "row" else 0
        init_size, init_rank = (1, 0) if parallel_mode == "duplicated" else _pg_size_rank(tp_group)
        if parallel_mode in ("column", "row") and te_parallel_mode is None:  # expert: local shard
            init_size, init_rank = _pg_size_rank(tp_group)
        _init_weight(self.weight, config, init_method, full_out, full_in, dim, init_rank, init_size)
        if is_expert:
            from megatron.core.extensions.transformer_engine import (
                _set_expert_parameter_attributes,
            )

            _set_expert_parameter_attributes(self, parallel_mode, use_expert_pgs)
        else:
            for param in self.parameters():
                param.allreduce = True
                if parallel_mode == "duplicated":
                    param.sequence_parallel = config.sequence_parallel
                    param.tensor_model_parallel = False
        self._tp_group = _tp_group_if_none(tp_group, is_expert)

    def _te_forward(self, x: torch.Tensor):
        """`te.pytorch.Linear.forward`: `out`, or `(out, bias)` with `return_bias`."""
        if self.parallel_mode == "column":
            x = _column_input(x, self.tp_group, self.sequence_parallel)
        add_bias = self.bias is not None and not self.return_bias
        bias_in_gemm = add_bias and self.parallel_mode != "row"
        out = F.linear(x, self.weight, self.bias if bias_in_gemm else None)
        if self.parallel_mode == "row":
            out = _row_output(out, self.tp_group, self.sequence_parallel)
            if add_bias:
                out = out + self.bias
        return (out, self.bias) if self.return_bias else out

    def forward(self, x: torch.Tensor):
        out = self._te_forward(x)
        self.is_first_microbatch = False
        if self.te_return_bias:
            return out
        return out, None

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return self._sharded(None, prefix, sharded_offsets, metadata)

    def _sharded(self, axis_map, prefix, sharded_offsets, metadata):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(
            state,
            prefix,
            axis_map,
            sharded_offsets,
            tp_group=self._tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )


class TEColumnParallelLinear(TELinear):
    """Megatron's `TEColumnParallelLinear`."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method,
        gather_output: bool,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        skip_weight_param_allocation: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group=None,
        stride: int = 1,
        name: str | None = None,
    ) -> None:
        if gather_output:
            raise ValueError("Transformer Engine linear layers do not support gather_output = True")
        tp_group = _tp_group_if_none(tp_group, is_expert)
        self.stride = stride
        super().__init__(
            input_size,
            output_size,
            parallel_mode="column",
            config=config,
            init_method=init_method,
            bias=bias,
            skip_bias_add=skip_bias_add,
            skip_weight_param_allocation=skip_weight_param_allocation,
            tp_comm_buffer_name=tp_comm_buffer_name,
            is_expert=is_expert,
            tp_group=tp_group,
            name=name,
        )

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return self._sharded({"weight": 0, "bias": 0}, prefix, sharded_offsets, metadata)


class TERowParallelLinear(TELinear):
    """Megatron's `TERowParallelLinear`."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method,
        bias: bool,
        input_is_parallel: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: str | None = None,
        tp_group=None,
        name: str | None = None,
    ) -> None:
        if not input_is_parallel:
            raise ValueError(
                "Transformer Engine linear layers do not support input_is_parallel = False"
            )
        tp_group = _tp_group_if_none(tp_group, is_expert)
        super().__init__(
            input_size,
            output_size,
            parallel_mode="row",
            config=config,
            init_method=init_method,
            bias=bias,
            skip_bias_add=skip_bias_add,
            skip_weight_param_allocation=False,
            tp_comm_buffer_name=tp_comm_buffer_name,
            is_expert=is_expert,
            tp_group=tp_group,
            name=name,
        )
        if bias:
            self.bias.sequence_parallel = config.sequence_parallel

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return self._sharded({"weight": 1}, prefix, sharded_offsets, metadata)


class TELayerNormColumnParallelLinear(torch.nn.Module):
    """Megatron's `TELayerNormColumnParallelLinear` (a `te.pytorch.LayerNormLinear`)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method,
        gather_output: bool,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        skip_weight_param_allocation: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group=None,
        stride: int = 1,
        name: str | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        if gather_output:
            raise ValueError("Transformer Engine linear layers do not support gather_output = True")
        if is_expert:
            raise ValueError("Transformer Engine linear layers do not yet support MoE")
        tp_group = _tp_group_if_none(tp_group, is_expert)
        self._tp_group = tp_group
        self.te_return_bias = skip_bias_add and bias
        self.is_first_microbatch = True
        self.tp_size, self.tp_rank = _pg_size_rank(tp_group)
        self.stride = stride
        # te.pytorch.LayerNormLinear
        self.parallel_mode = "column"
        self.tp_group = tp_group if self.tp_size > 1 else None
        self.sequence_parallel = self.tp_size > 1 and bool(config.sequence_parallel)
        self.in_features = input_size
        self.out_features = output_size // self.tp_size
        self.normalization = config.normalization
        self.eps = config.layernorm_epsilon
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.return_layernorm_output = False
        self.return_layernorm_output_gathered = False
        self.use_bias = bias
        self.return_bias = self.te_return_bias
        dtype = config.params_dtype
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(init(input_size, dtype=dtype))
        self.layer_norm_weight.sequence_parallel = self.sequence_parallel
        if self.normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(torch.zeros(input_size, dtype=dtype))
            self.layer_norm_bias.sequence_parallel = self.sequence_parallel
        else:
            self.layer_norm_bias = None
        self.weight = torch.nn.Parameter(torch.empty(self.out_features, input_size, dtype=dtype))
        _mark_parallel(self.weight, "column")
        self.weight.partition_stride = stride
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(self.out_features, dtype=dtype))
            _mark_parallel(self.bias, "column")
            self.bias.allreduce = True
        else:
            self.bias = None
        _init_weight(
            self.weight, config, init_method, output_size, input_size, 0, self.tp_rank, self.tp_size
        )
        for param in self.parameters():
            param.allreduce = True

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.layer_norm_weight + 1 if self.zero_centered_gamma else self.layer_norm_weight
        if self.normalization == "RMSNorm":
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        return F.layer_norm(x, (x.shape[-1],), weight, self.layer_norm_bias, self.eps)

    def _te_forward(self, x: torch.Tensor):
        """`te.pytorch.LayerNormLinear.forward`: out[, bias][, ln_out]."""
        ln_out = self._norm(x)
        ln_out_total = _column_input(ln_out, self.tp_group, self.sequence_parallel)
        add_bias = self.bias is not None and not self.return_bias
        out = F.linear(ln_out_total, self.weight, self.bias if add_bias else None)
        result = [out]
        if self.return_bias:
            result.append(self.bias)
        if self.return_layernorm_output:
            result.append(ln_out_total if self.return_layernorm_output_gathered else ln_out)
        return tuple(result) if len(result) > 1 else out

    def forward(self, x: torch.Tensor):
        out = self._te_forward(x)
        self.is_first_microbatch = False
        if self.te_return_bias:
            return out
        return out, None

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group,
            make_sharded_tensors_for_checkpoint,
        )

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(
            state,
            prefix,
            {"weight": 0, "bias": 0},
            sharded_offsets,
            tp_group=self._tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )


class TEGroupedLinear(torch.nn.Module):
    """Megatron's `TEGroupedLinear` (a `te.pytorch.GroupedLinear`), experts only."""

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        parallel_mode: str | None,
        config,
        init_method,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        pg_collection=None,
        name: str | None = None,
    ) -> None:
        super().__init__()
        from megatron.core.extensions.transformer_engine import _set_expert_parameter_attributes
        from megatron.core.process_groups_config import ProcessGroupCollection

        assert is_expert, "TEGroupedLinear only supports expert parallelism"
        self.config = config
        self.te_return_bias = skip_bias_add and bias
        self.is_first_microbatch = True
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self._pg_collection = pg_collection
        self._tp_group = pg_collection.expt_tp
        tp_size, tp_rank = _pg_size_rank(self._tp_group)
        self.expert_parallel = config.expert_model_parallel_size > 1
        use_expert_pgs = self.expert_parallel or (
            config.expert_tensor_parallel_size != config.tensor_model_parallel_size
        )
        self.explicit_expert_comm = tp_size > 1 or self.expert_parallel
        original_parallel_mode = parallel_mode
        full_in, full_out = input_size, output_size
        te_tp_size, tp_group_for_te = tp_size, self._tp_group
        if self.explicit_expert_comm:
            if parallel_mode == "column":
                output_size //= tp_size
            elif parallel_mode == "row":
                input_size //= tp_size
            parallel_mode, te_tp_size, tp_group_for_te = None, 1, None
        self.num_gemms = num_gemms
        self.parallel_mode = parallel_mode
        self.tp_size = te_tp_size
        self.tp_group = tp_group_for_te if te_tp_size > 1 else None
        self.sequence_parallel = te_tp_size > 1 and bool(config.sequence_parallel)
        self.in_features = input_size // te_tp_size if parallel_mode == "row" else input_size
        self.out_features = output_size // te_tp_size if parallel_mode == "column" else output_size
        self.use_bias = bias
        self.return_bias = self.te_return_bias
        dim = 1 if original_parallel_mode == "row" else 0
        for i in range(num_gemms):
            w = torch.nn.Parameter(
                torch.empty(self.out_features, self.in_features, dtype=config.params_dtype)
            )
            _init_weight(w, config, init_method, full_out, full_in, dim, tp_rank, tp_size)
            self.register_parameter(f"weight{i}", w)
            if bias:
                b = torch.zeros(self.out_features, dtype=config.params_dtype)
                self.register_parameter(f"bias{i}", torch.nn.Parameter(b))
        _set_expert_parameter_attributes(self, original_parallel_mode, use_expert_pgs)

    def _te_forward(self, x: torch.Tensor, m_splits):
        if self.parallel_mode == "column":
            x = _column_input(x, self.tp_group, self.sequence_parallel)
        pieces = torch.split(x, list(m_splits))
        outs = []
        for i, xe in enumerate(pieces):
            bias = getattr(self, f"bias{i}") if self.use_bias and not self.return_bias else None
            outs.append(F.linear(xe, getattr(self, f"weight{i}"), bias))
        out = torch.cat(outs) if outs else x.new_zeros(0, self.out_features)
        if self.parallel_mode == "row":
            out = _row_output(out, self.tp_group, self.sequence_parallel)
        if self.return_bias:
            return out, [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
        return out

    def forward(self, x: torch.Tensor, m_splits):
        out = self._te_forward(x, m_splits)
        self.is_first_microbatch = False
        if self.te_return_bias:
            return out
        return out, None

    def _sharded_state_dict_grouped(
        self, tp_axis_map, prefix="", sharded_offsets=(), metadata=None
    ):
        """As Megatron's: per GEMM, the expert axis appended to `sharded_offsets`, keys
        `{prefix}weight{i}` all naming one tensor `{prefix}weight` with the expert axis."""
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        out = {}
        full = self.state_dict(prefix="", keep_vars=True)
        ep = self._pg_collection.ep
        ep_size, ep_rank = _pg_size_rank(ep)
        ep_axis = len(sharded_offsets)
        for i in range(self.num_gemms):
            global_expert = ep_rank * self.num_gemms + i
            state = {f"{i}.weight": full[f"weight{i}"]}
            if self.use_bias:
                state[f"{i}.bias"] = full[f"bias{i}"]
            offsets = (*sharded_offsets, (ep_axis, global_expert, ep_size * self.num_gemms))
            sub = make_sharded_tensors_for_checkpoint(
                state,
                "",
                tp_axis_map,
                offsets,
                tp_group=self._tp_group,
                dp_cp_group=metadata["dp_cp_group"],
            )
            replace_prefix_for_sharding(sub, f"{i}.", prefix)
            out[f"{prefix}weight{i}"] = sub[f"{i}.weight"]
            if self.use_bias:
                out[f"{prefix}bias{i}"] = sub[f"{i}.bias"]
        edp_rank = _pg_size_rank(self._pg_collection.expt_dp)[1]
        for sh_ten in out.values():
            sh_ten.replica_id = (*sh_ten.replica_id[:2], edp_rank)
        return out


class TEColumnParallelGroupedLinear(TEGroupedLinear):
    """Megatron's `TEColumnParallelGroupedLinear`."""

    def __init__(self, num_gemms, input_size, output_size, **kwargs) -> None:
        super().__init__(num_gemms, input_size, output_size, parallel_mode="column", **kwargs)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        axes = {}
        for i in range(self.num_gemms):
            axes.update({f"{i}.weight": 0, f"{i}.bias": 0})
        return self._sharded_state_dict_grouped(axes, prefix, sharded_offsets, metadata)


class TERowParallelGroupedLinear(TEGroupedLinear):
    """Megatron's `TERowParallelGroupedLinear`."""

    def __init__(self, num_gemms, input_size, output_size, **kwargs) -> None:
        super().__init__(num_gemms, input_size, output_size, parallel_mode="row", **kwargs)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        axes = {f"{i}.weight": 1 for i in range(self.num_gemms)}
        return self._sharded_state_dict_grouped(axes, prefix, sharded_offsets, metadata)


def _spec_provider_class():
    from megatron.core.models.backends import BackendSpecProvider

    class StandinSpecProvider(BackendSpecProvider):
        """`TESpecProvider` with the stand-in linears; Megatron's local attention and a torch
        norm (`norm`, default `WrappedTorchNorm`) instead of TE's."""

        norm: Any = None

        def linear(self):
            return TELinear

        def column_parallel_linear(self):
            return TEColumnParallelLinear

        def row_parallel_linear(self):
            return TERowParallelLinear

        def fuse_layernorm_and_linear(self) -> bool:
            return True

        def column_parallel_layer_norm_linear(self):
            return TELayerNormColumnParallelLinear

        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual=False):
            from megatron.core.transformer.torch_norm import WrappedTorchNorm

            return self.norm or WrappedTorchNorm

        def core_attention(self):
            from megatron.core.transformer.dot_product_attention import DotProductAttention

            return DotProductAttention

        def grouped_mlp_modules(self, moe_use_grouped_gemm: bool):
            from functools import partial

            from megatron.core.transformer.mlp import MLPSubmodules
            from megatron.core.transformer.moe.experts import (
                GroupedMLPSubmodules,
                SequentialMLP,
                TEGroupedMLP,
            )

            if moe_use_grouped_gemm:
                return partial(
                    TEGroupedMLP,
                    submodules=GroupedMLPSubmodules(
                        linear_fc1=TEColumnParallelGroupedLinear,
                        linear_fc2=TERowParallelGroupedLinear,
                        activation_func=None,
                    ),
                )
            return partial(
                SequentialMLP,
                submodules=MLPSubmodules(
                    linear_fc1=TEColumnParallelLinear,
                    linear_fc2=TERowParallelLinear,
                    activation_func=None,
                ),
            )

        def activation_func(self):
            return None

    return StandinSpecProvider


def __getattr__(name: str):
    if name == "StandinSpecProvider":  # built lazily: megatron is imported on first use
        return _spec_provider_class()
    raise AttributeError(name)


@contextlib.contextmanager
def _te_spec_provider(provider) -> Iterator[None]:
    from megatron.core.models.gpt import gpt_layer_specs

    saved = gpt_layer_specs.TESpecProvider
    gpt_layer_specs.TESpecProvider = lambda: provider
    try:
        yield
    finally:
        gpt_layer_specs.TESpecProvider = saved


def te_standin_layer_spec(
    num_experts: int | None = None, moe_grouped_gemm: bool = False, norm=None
):
    """Megatron's own `get_gpt_layer_with_transformer_engine_spec` with the stand-in classes
    in place of TE's: the layer layout (layernorm fused into QKV and dense FC1, `IdentityOp`
    input norms, the MoE/grouped expert modules) is exactly what Megatron builds with TE."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )

    provider = _spec_provider_class()()
    provider.norm = norm
    with _te_spec_provider(provider):
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm
        )
