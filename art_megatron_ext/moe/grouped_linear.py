"""`ArtGroupedLinear`: the linears of all local experts as one grouped GEMM (a LoRA site).

Why a module per linear (and not two bare parameters on the MLP): LoRA, export and checkpoint
code find expert linears by name (`linear_fc1`, `linear_fc2`) and call shape, as they find
Transformer Engine's grouped linears. This module has that shape, `forward(x, m_splits) ->
(out, None)` over rows sorted by expert, plus `num_gemms` and a stacked `weight`
[L, in, out] (the layout `grouped_gemm` takes, flagged by `art_stacked_weight`), so
`attach_lora` turns it into a grouped LoRA site (art_megatron_ext/lora/grouped.py).
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
        config: Megatron `TransformerConfig` (dtype, device, gated_linear_unit for LoRA).
        backend: `grouped_gemm` backend ("auto", "cutlass", "torch").
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
        return grouped_gemm(x, self.weight, m_splits, backend=self.grouped_gemm_backend), None

    def extra_repr(self) -> str:
        experts, fan_in, fan_out = self.weight.shape
        return f"experts={experts}, in={fan_in}, out={fan_out}, kind={self.art_lora_kind}"
