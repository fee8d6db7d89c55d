"""Run Megatron-core code on CPU in tests: the GPU stand-ins, parallel state, MoE layers.

`cpu_shim` and `cuda_tensor_type_names` live in the package (`art_megatron_ext.cpu_stand_in`:
the example trainer enters them too on a machine without a GPU) and are re-exported here.
With them a real `MoELayer` (fp32, `use_cpu_initialization=True`, local spec so
`SequentialMLP`, no TE) runs forward and backward on a gloo group, which lets us compare
dispatchers exactly on a box without a GPU (see ../shared/docs/megatron-and-cuda-here.md).
They patch `torch` process-wide while active, so enter them inside spawned rank processes.

Usage::

    with cpu_shim(), megatron_parallel(tp=1, ep=2):
        layer = build_moe_layer(config)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from art_megatron_ext.cpu_stand_in import cpu_shim, cuda_tensor_type_names

__all__ = [
    "build_moe_layer",
    "cpu_shim",
    "cuda_tensor_type_names",
    "gloo_world_of_one",
    "megatron_parallel",
    "moe_test_config",
]


@contextlib.contextmanager
def megatron_parallel(
    tp: int = 1, ep: int = 1, pp: int = 1, etp: int | None = None
) -> Iterator[None]:
    """Initialize Megatron's parallel state on the current (gloo) world; destroy it on exit.

    `model_parallel_cuda_manual_seed` needs CUDA, so only the CPU generator is seeded here:
    call `torch.manual_seed` yourself for reproducible weights.
    """
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,  # None: Megatron's default, the TP size
    )
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()


@contextlib.contextmanager
def gloo_world_of_one() -> Iterator[None]:
    """In this process: a gloo world of 1 (unless one exists), TP=1 parallel state and the
    CPU stand-ins; the CPU twin of `support.cuda_world.nccl_world_of_one`."""
    import os
    import tempfile

    created = not torch.distributed.is_initialized()
    if created:
        rdzv = os.path.join(tempfile.mkdtemp(prefix="art_gloo_one_"), "rdzv")
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{rdzv}", rank=0, world_size=1
        )
    try:
        with cpu_shim(), megatron_parallel():
            yield
    finally:
        if created:
            torch.distributed.destroy_process_group()


def moe_test_config(**overrides: Any) -> Any:
    """A small fp32 CPU `TransformerConfig` for one MoE layer; `overrides` win.

    Defaults: hidden 16, ffn 32, 8 experts, top-2, fp32 router, no aux loss, alltoall
    dispatcher, CPU initialization, no bias-activation fusion (it needs a GPU).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    base: dict[str, Any] = dict(
        num_layers=1,
        hidden_size=16,
        ffn_hidden_size=32,
        moe_ffn_hidden_size=32,
        num_attention_heads=4,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_router_dtype="fp32",
        moe_aux_loss_coeff=0.0,
        moe_router_load_balancing_type="none",
        moe_token_dispatcher_type="alltoall",
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
        add_bias_linear=False,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
        moe_grouped_gemm=False,
        sequence_parallel=False,
    )
    base.update(overrides)
    tp = base.get("tensor_model_parallel_size", 1)
    if tp > 1 and "sequence_parallel" not in overrides:
        base["sequence_parallel"] = True  # Megatron requires SP for MoE with TP > 1
    return TransformerConfig(**base)


def build_moe_layer(config: Any, layer_number: int = 1) -> Any:
    """Build a real `MoELayer` with the local (non-TE) spec: `SequentialMLP` experts."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    make_layer = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts)
    return make_layer(config=config, layer_number=layer_number)
