"""Stand-ins for Transformer Engine's grouped expert linears, for the grouped LoRA tests.

Not collected by pytest. Why: TE needs a GPU; the grouped LoRA site only needs the call shape
`forward(x, m_splits) -> (out, bias)`, the per-expert `weight0..` parameters and the attributes
Megatron's TE grouped linears carry. The base runs `grouped_linear_ref`, one GEMM per expert.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from art_megatron_ext.lora.grouped import grouped_linear_ref


class FakeColumnParallelGroupedLinear(torch.nn.Module):
    """Same call shape and attributes as Megatron's TEColumnParallelGroupedLinear."""

    def __init__(
        self, num_gemms: int, in_features: int, out_features: int, gated: bool = True
    ) -> None:
        super().__init__()
        self.num_gemms = num_gemms
        self.config = SimpleNamespace(gated_linear_unit=gated)
        self.explicit_expert_comm = False
        self.tp_group = None
        for i in range(num_gemms):
            w = torch.randn(out_features, in_features) / in_features**0.5
            self.register_parameter(f"weight{i}", torch.nn.Parameter(w))

    def forward(self, x, m_splits):
        weights = torch.stack([getattr(self, f"weight{i}") for i in range(self.num_gemms)])
        return grouped_linear_ref(x, weights, m_splits), None


class FakeRowParallelGroupedLinear(FakeColumnParallelGroupedLinear):
    """Same call shape as Megatron's TERowParallelGroupedLinear."""
