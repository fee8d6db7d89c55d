"""Fixtures for the LoRA tests: an in-process Megatron world of one rank on CPU.

Everything here is torn down after each test module, so other test packages see no
process group and no Megatron parallel state.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from support.gpt_shapes import TINY as TINY_SHAPE


@pytest.fixture(scope="module")
def megatron_world():
    """gloo world of 1, Megatron parallel state TP=1, CUDA-only calls stood in for."""
    from megatron.core import parallel_state

    from art_megatron_ext.lora.cpu_runtime import cpu_megatron

    created = not torch.distributed.is_initialized()
    tmp = tempfile.mkdtemp(prefix="art_lora_pg_")
    if created:
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{os.path.join(tmp, 'rdzv')}", rank=0, world_size=1
        )
    parallel_state.initialize_model_parallel(1, 1)
    try:
        with cpu_megatron():
            yield
    finally:
        parallel_state.destroy_model_parallel()
        if created:
            torch.distributed.destroy_process_group()


@pytest.fixture()
def tiny_shape():
    from art_megatron_ext.lora.tiny_gpt import GptShape

    return GptShape(**TINY_SHAPE)


def _lm_loss(model, seed: int = 0, batch: int = 2, seq: int = 12) -> torch.Tensor:
    """Mean LM loss of `model` on seeded random tokens (inputs the tests share)."""
    from art_megatron_ext.lora.cpu_runtime import causal_mask

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, TINY_SHAPE["vocab_size"], (batch, seq + 1), generator=g)
    positions = torch.arange(seq).expand(batch, seq)
    return model(tokens[:, :-1], positions, causal_mask(seq), labels=tokens[:, 1:]).mean()


def _randomize_b_(model, slot: str, seed: int, scale: float = 0.05) -> None:
    """Give slot `slot` non-zero B everywhere (logical region only), so it changes outputs."""
    from art_megatron_ext.lora import iter_lora_sites
    from art_megatron_ext.lora.padding import logical_view

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for entry in iter_lora_sites(model):
            if entry.slot == slot:
                view = logical_view(entry.adapter.b)
                view.copy_(torch.randn(view.shape, generator=g) * scale)


@pytest.fixture()
def make_lora_gpt(megatron_world, tiny_shape):
    """Factory: a tiny-shaped GPT (seeded) with LoRA attached (`LoraConfig` overrides)."""
    from art_megatron_ext.lora import LoraConfig, attach_lora
    from art_megatron_ext.lora.tiny_gpt import build_gpt

    def make(recompute: bool = False, **lora):
        torch.manual_seed(0)
        model = build_gpt(tiny_shape, recompute=recompute)
        attach_lora(model, LoraConfig(**{"rank": 8, "alpha": 16.0, **lora}))
        return model

    return make


@pytest.fixture()
def lm_loss():
    """`lm_loss(model, seed=0)`: mean LM loss on seeded random tokens."""
    return _lm_loss


@pytest.fixture()
def randomize_b():
    """`randomize_b(model, slot, seed)`: non-zero B for a slot (logical region only)."""
    return _randomize_b_
