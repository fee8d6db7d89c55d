"""`ArtGroupedMLP`: Megatron expert MLP on our grouped GEMM op (no Transformer Engine needed).

Why: Megatron-core 0.19 offers grouped experts only through Transformer Engine (`TEGroupedMLP`);
without TE a trainer falls back to `SequentialMLP`, one matmul per expert. This module keeps
`SequentialMLP`'s maths (fc1, activation or GLU, per-token prob scale, fc2) but runs each
linear as one `grouped_gemm` over all local experts: CUTLASS on sm_90, `torch._grouped_mm`
elsewhere. Select it with `art_moe_layer_spec(...)` in place of Megatron's MoE spec.

The two linears are `ArtGroupedLinear` children named `linear_fc1` and `linear_fc2`, as in
Megatron's `TEGroupedMLP`, so `attach_lora` makes them grouped LoRA sites (one A/B pair per
local expert, run through the same grouped GEMM op). Weights are stored expert-major and
input-major, the layout the op takes: `linear_fc1.weight` [L, hidden, F1] (F1 = 2*ffn for gated
units: gate columns first, then up, as Megatron's `torch.chunk`) and `linear_fc2.weight`
[L, ffn, hidden]; expert e's `SequentialMLP` weights are the transposes
(`copy_from_sequential_mlp`).

Dist checkpoints (`sharded_state_dict`) use Megatron's expert keys and layout, those of
`SequentialMLP` and `TEGroupedMLP`: `...mlp.experts.experts.linear_fc1.weight` (Megatron's
doubled `experts.`), global [experts, F1, hidden], each local expert at its global index
`ep_rank * L + e`, replicated over expert data parallel. So a checkpoint saved at one
expert-parallel size loads at another, and one saved with Megatron's experts loads into these
(not the reverse: Megatron's experts also ask for their linears' `_extra_state`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from art_megatron_ext.moe.grouped_linear import ArtGroupedLinear
from art_megatron_ext.ops import BACKENDS


@dataclass(frozen=True)
class GroupedMLPOptions:
    """How the expert GEMMs run: "auto" (CUTLASS on sm_90 bf16, else torch), "cutlass", "torch"."""

    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"GroupedMLPOptions.backend={self.backend!r}; expected {BACKENDS}")


def _megatron_module():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class ArtGroupedMLP(_megatron_module()):
    """Experts of one MoE layer as two grouped GEMMs (the `ExpertsBuilder` signature).

    Args:
        num_local_experts: L, experts on this rank.
        config: Megatron `TransformerConfig` (moe_ffn_hidden_size, gated_linear_unit,
            activation_func, init methods, params_dtype).
        pg_collection: Megatron's process groups; expert tensor parallelism must be 1.
        options: `GroupedMLPOptions`.
    """

    def __init__(
        self,
        num_local_experts,
        config,
        *,
        pg_collection=None,
        name=None,
        options: GroupedMLPOptions | None = None,
    ):
        super().__init__(config=config)
        self.options = options or GroupedMLPOptions()
        self.num_local_experts = num_local_experts
        self.ep_group = getattr(pg_collection, "ep", None)
        expt_dp = getattr(pg_collection, "expt_dp", None)
        expt_tp = getattr(pg_collection, "expt_tp", None)
        if expt_tp is not None and expt_tp.size() != 1:
            raise ValueError(
                f"ArtGroupedMLP supports expert tensor parallel size 1, got {expt_tp.size()}"
            )
        if config.add_bias_linear:
            raise ValueError("ArtGroupedMLP has no expert biases; set add_bias_linear=False")
        if config.fp8 or config.fp4:
            raise ValueError("ArtGroupedMLP runs bf16/fp32 experts; fp8/fp4 needs TEGroupedMLP")
        ffn = config.moe_ffn_hidden_size
        fc1_out = 2 * ffn if config.gated_linear_unit else ffn
        shared = dict(
            config=config, backend=self.options.backend, ep_group=self.ep_group,
            expt_dp_group=expt_dp,
        )  # fmt: skip
        self.linear_fc1 = ArtGroupedLinear(
            num_local_experts, config.hidden_size, fc1_out, kind="column", **shared
        )
        self.linear_fc2 = ArtGroupedLinear(
            num_local_experts, ffn, config.hidden_size, kind="row", **shared
        )
        self.linear_fc1.init_like_megatron(config.init_method)
        self.linear_fc2.init_like_megatron(config.output_layer_init_method)

    @property
    def weight1(self) -> torch.nn.Parameter:
        """fc1 weights of every local expert, [L, hidden, F1]."""
        return self.linear_fc1.weight

    @property
    def weight2(self) -> torch.nn.Parameter:
        """fc2 weights of every local expert, [L, ffn, hidden]."""
        return self.linear_fc2.weight

    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        if not cfg.gated_linear_unit:
            return cfg.activation_func(h)
        x_glu, x_linear = torch.chunk(h, 2, dim=-1)
        if (clamp := cfg.activation_func_clamp_value) is not None:
            x_glu = x_glu.clamp(min=None, max=clamp)
            x_linear = x_linear.clamp(min=-clamp, max=clamp)
        return cfg.activation_func(x_glu) * (x_linear + cfg.glu_linear_offset)

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        """Same contract as `SequentialMLP.forward`: returns (output [rows, hidden], None)."""
        hidden = permuted_local_hidden_states
        if self.config.moe_apply_probs_on_input:
            hidden = (permuted_probs.unsqueeze(-1) * hidden).to(hidden.dtype)
            permuted_probs = torch.ones_like(permuted_probs)
        h, _ = self.linear_fc1(hidden, tokens_per_expert)
        h = self._activation(h)
        h = (h * permuted_probs.unsqueeze(-1)).to(h.dtype)
        out, _ = self.linear_fc2(h, tokens_per_expert)
        return out, None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """Each linear's entries (`ArtGroupedLinear.sharded_state_dict`) under Megatron's expert
        keys: `{prefix}experts.linear_fc1.*`, as `TEGroupedMLP` names them (so its LoRA
        entries, too, are those of a `TEGroupedMLP` with the same sites). State-dict keys stay
        the module's own (`{prefix}linear_fc1.weight`), for `load_state_dict`."""
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
        from megatron.core.transformer.utils import sharded_state_dict_default

        entries = {}
        for name, module in self.named_children():
            sub = sharded_state_dict_default(module, f"{name}.", sharded_offsets, metadata)
            replace_prefix_for_sharding(sub, f"{name}.", f"{prefix}experts.{name}.")
            entries.update({f"{prefix}{key}": value for key, value in sub.items()})
        return entries

    def backward_dw(self) -> None:
        """Weight gradients are computed in the main backward (no delayed wgrad)."""

    @torch.no_grad()
    def copy_from_sequential_mlp(self, sequential) -> None:
        """Load the weights of a Megatron `SequentialMLP` with the same config (for tests and
        for converting checkpoints)."""
        for e, expert in enumerate(sequential.local_experts):
            self.weight1[e].copy_(expert.linear_fc1.weight.t())
            self.weight2[e].copy_(expert.linear_fc2.weight.t())


def art_moe_layer_spec(num_experts: int, options: GroupedMLPOptions | None = None):
    """Megatron's local (non-TE) MoE layer spec with `ArtGroupedMLP` as the experts."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    base = get_moe_module_spec(use_te=False, num_experts=num_experts)
    submodules = MoESubmodules(
        **{
            **base.keywords["submodules"].__dict__,
            "experts": partial(ArtGroupedMLP, options=options or GroupedMLPOptions()),
        }
    )
    return partial(base.func, submodules=submodules)
