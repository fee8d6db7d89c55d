"""MoE pieces for Megatron-core: the HybridEP hook-up for the flex dispatcher."""

from art_megatron_ext.moe.hybridep_hookup import (
    HybridEPOptions,
    HybridEPPatch,
    enable_hybridep,
    hybridep_enabled,
)

__all__ = ["HybridEPOptions", "HybridEPPatch", "enable_hybridep", "hybridep_enabled"]
