"""Autograd ops for Megatron experts (grouped GEMM on CUTLASS sm_90a or torch._grouped_mm)."""

from art_megatron_ext.ops.grouped_gemm import (
    BACKENDS,
    GroupedGemmBackendError,
    GroupedGemmFunction,
    grouped_gemm,
    resolve_backend,
)

__all__ = [
    "BACKENDS",
    "GroupedGemmBackendError",
    "GroupedGemmFunction",
    "grouped_gemm",
    "resolve_backend",
]
