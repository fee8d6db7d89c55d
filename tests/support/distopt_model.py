"""A LoRA GPT under Megatron DDP + DistributedOptimizer on CPU, shared by the optimizer tests.

Not collected by pytest; imported by the test modules and by their spawned rank workers.
"""

from __future__ import annotations

import torch

SHAPE = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=64,
)
SEQ = 16
ATOL = 1e-6  # float32 reduction-order differences; a missing reduction is off by O(|grad|)


def global_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, SHAPE["vocab_size"], (2, SEQ + 1), generator=g)


def build(tp: int, dtype: torch.dtype):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from art_megatron_ext.lora import LoraConfig, attach_lora
    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt

    torch.manual_seed(0)
    model = build_gpt(
        GptShape(**SHAPE), tensor_parallel=tp, sequence_parallel=tp > 1, params_dtype=dtype
    )
    attach_lora(model, LoraConfig(rank=8, alpha=16.0))
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=False, grad_reduce_in_fp32=True
    )
    return DistributedDataParallel(model.config, ddp_config, model)


def optimizer_builder(ddp, name: str, bf16: bool, lr: float, eps: float = 1e-8):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer=name,
        lr=lr,
        adam_eps=eps,
        weight_decay=0.0,
        clip_grad=0.0,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=True,
    )
    return lambda params: get_megatron_optimizer(config, [ddp])


def train_step(ddp, optimizer, step: int, rows: slice, mask_optimizer: bool = False) -> None:
    """One step on `rows` of step `step`'s global batch. `mask_optimizer`: the padding is
    zeroed in the optimizer's state too, before and after the step (`zero_lora_padding_` with
    the optimizer); otherwise only in the parameters and grads, before the step."""
    from megatron.core.distributed import finalize_model_grads

    from art_megatron_ext.lora import zero_lora_padding_
    from art_megatron_ext.lora.cpu_runtime import causal_mask

    tokens = global_batch(step)[rows]
    positions = torch.arange(SEQ).expand(tokens.shape[0], SEQ)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    loss = ddp(tokens[:, :-1], positions, causal_mask(SEQ), labels=tokens[:, 1:]).mean()
    loss.backward()
    finalize_model_grads([ddp])
    zero_lora_padding_(ddp.module, optimizer if mask_optimizer else None)
    ok, _, _ = optimizer.step()
    assert ok
    if mask_optimizer:
        zero_lora_padding_(ddp.module, optimizer)


def wrap_overlapped(model, overlap: bool, bucket_size: int, weight_decay: float):
    """(DDP wrapper, Megatron DistributedOptimizer) for `model` with `overlap_grad_reduce` and
    `overlap_param_gather` both `overlap`, and buckets of `bucket_size` elements (small ones
    spread LoRA over several bucket groups). Adam, lr 0.05, no clipping, fp32 grad reduce.
    The model's config gets DDP's grad finalization and no-sync hooks (`scheduled_step`)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap,
        grad_reduce_in_fp32=True,
        bucket_size=bucket_size,
    )
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=0.05,
            weight_decay=weight_decay,
            clip_grad=0.0,
            use_distributed_optimizer=True,
            overlap_param_gather=overlap,
        ),
        [ddp],
    )
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = ddp.no_sync
    return ddp, optimizer


def scheduled_step(ddp, optimizer, tokens: torch.Tensor) -> float:
    """One optimizer step on `tokens` through Megatron's own schedule
    (`get_forward_backward_func`, which runs DDP's hooks as a trainer's step does); the loss."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from art_megatron_ext.lora.cpu_runtime import causal_mask

    mask = causal_mask(SEQ)

    def forward_step(data_iterator, module):
        batch = next(data_iterator)
        positions = torch.arange(SEQ).expand(batch.shape[0], SEQ)
        loss = module(batch[:, :-1], positions, mask, labels=batch[:, 1:]).mean()
        return loss, lambda value: (value, {"loss": value.detach()})

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    out = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([tokens]),
        model=[ddp],
        num_microbatches=1,
        seq_length=SEQ,
        micro_batch_size=1,
        forward_only=False,
    )
    ok, _, _ = optimizer.step()
    assert ok
    return float(out[0]["loss"])
