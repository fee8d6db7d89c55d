"""MoE pieces for Megatron-core: the HybridEP hook-up for the flex dispatcher, and a grouped
expert MLP on our grouped GEMM (for trainers without Transformer Engine)."""

from art_megatron_ext.moe.grouped_mlp import ArtGroupedMLP, GroupedMLPOptions, art_moe_layer_spec
from art_megatron_ext.moe.hybridep_hookup import (
    HybridEPOptions,
    HybridEPPatch,
    enable_hybridep,
    hybridep_enabled,
)

__all__ = [
    "ArtGroupedMLP",
    "GroupedMLPOptions",
    "HybridEPOptions",
    "HybridEPPatch",
    "art_moe_layer_spec",
    "enable_hybridep",
    "hybridep_enabled",
]
