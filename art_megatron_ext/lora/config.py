"""Typed configuration for LoRA on Megatron-core modules.

Why: LoRA shape decisions (rank, scaling, which linears, how tensors are padded for kernels)
are made once, here, and validated with messages that name the bad field; nothing reads an
environment variable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Megatron-core attribute names of the linears we know how to wrap, and what they are.
ATTENTION_QKV = "linear_qkv"
ATTENTION_PROJ = "linear_proj"
MLP_FC1 = "linear_fc1"
MLP_FC2 = "linear_fc2"
KNOWN_TARGETS = (ATTENTION_QKV, ATTENTION_PROJ, MLP_FC1, MLP_FC2)
DEFAULT_SLOT = "default"


@dataclass(frozen=True)
class LoraPadding:
    """How LoRA tensors are allocated larger than their logical shape.

    Args:
        rank_multiple: the rank dimension of every A and B is padded to a multiple of this
            (16 suits tensor-core tiles and the 16-byte stride rule of grouped GEMMs).
        expert_row_multiple: for grouped expert sites, each expert's B rows (output features)
            are padded to a multiple of this (8 bf16 elements = 16 bytes).
    """

    rank_multiple: int = 16
    expert_row_multiple: int = 8

    def __post_init__(self) -> None:
        for name in ("rank_multiple", "expert_row_multiple"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LoraPadding.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class LoraConfig:
    """What `attach_lora` adds to a model.

    Args:
        rank: logical LoRA rank r of the slot created at attach time.
        alpha: LoRA alpha; the delta is scaled by alpha / r (PEFT's convention, no rsLoRA).
        targets: Megatron linear attribute names to wrap (subset of `KNOWN_TARGETS`); they
            match in attention, dense MLP and expert MLPs alike.
        padding: padded allocation (see `LoraPadding`).
        init_seed: seed of A's initialization; A is drawn on the full (unsharded) logical
            shape, so a model gets the same adapter at every tensor-parallel size.
        slot: name of the slot created at attach time (None: create no slot).
        dtype: dtype of the LoRA parameters (None: the base weight's dtype); e.g. float32
            adapters on a bf16 model. The delta is cast to the base output's dtype.
    """

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = KNOWN_TARGETS
    padding: LoraPadding = field(default_factory=LoraPadding)
    init_seed: int = 0
    slot: str | None = DEFAULT_SLOT
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoraConfig.rank must be a positive int, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoraConfig.alpha must be > 0, got {self.alpha!r}")
        unknown = sorted(set(self.targets) - set(KNOWN_TARGETS))
        if unknown or not self.targets:
            raise ValueError(
                f"LoraConfig.targets {tuple(self.targets)!r}: unknown {unknown}; "
                f"choose from {KNOWN_TARGETS}"
            )
