"""The smallest module tree Megatron-side code walks like a GPT: `model.decoder.layers.0.mlp`
(LoRA attach and export name sites by their layer number)."""

from __future__ import annotations

import torch


def in_a_decoder_layer(mlp: torch.nn.Module) -> torch.nn.Module:
    """model.decoder.layers.0.mlp = `mlp`, layer number 1."""
    layer = torch.nn.Module()
    layer.layer_number = 1
    layer.mlp = mlp
    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([layer])
    return model


def with_experts(experts: torch.nn.Module) -> torch.nn.Module:
    """A model whose one layer's `mlp.experts` is `experts`."""
    mlp = torch.nn.Module()
    mlp.experts = experts
    return in_a_decoder_layer(mlp)
