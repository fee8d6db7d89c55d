"""The trainer's model: Megatron GPT + LoRA slot, under Megatron DDP and DistributedOptimizer.

`build_policy` builds the GPT shaped like the tiny model, loads its HF weights, moves it to the
rank's device (`placement.py`), attaches LoRA and imports the adapter the server serves as
version 0 (both sides start equal).
`data_parallel` wraps it the way multi-GPU Megatron trainers run: `DistributedDataParallel`
with the distributed optimizer, `overlap_grad_reduce` and `overlap_param_gather` (LoRA takes
part in the parameter all-gather like any parameter: `finish_lora_param_sync`), and
`calculate_per_token_loss`, so that DDP sums gradients and `finalize_model_grads` divides them
by the global batch's token weight: the loss is normalised over the global batch, not per rank.
DDP allocates its gradient buffers on the current device: the model's, on CUDA
(`placement.init_ranks` makes the rank's GPU current).
"""

from __future__ import annotations

import torch
from loop_config import LoopConfig


class LogicalRope(torch.nn.Module):
    """Megatron's GPTModel rotates token i of a row by RoPE position i. In a packed prefix tree
    a branch does not sit at its logical position (the second completion of a group starts
    right after the first, not after the prompt), so the rotary embedding must be looked up at
    each token's `input_pos`, as vLLM does. Set `.positions` ([rows, seq]) before a forward."""

    def __init__(self, rope: torch.nn.Module):
        super().__init__()
        self.rope = rope
        self.positions: torch.Tensor | None = None

    def get_rotary_seq_len(self, *args, **kwargs):
        return self.rope.get_rotary_seq_len(*args, **kwargs)

    def forward(self, seq_len: int, **kwargs) -> torch.Tensor:
        if self.positions is None:
            raise RuntimeError("LogicalRope.positions must be set before the forward")
        table = self.rope(int(self.positions.max()) + 1, **kwargs)  # [max_pos + 1, 1, 1, dim]
        return table[:, 0, 0, :][self.positions.T].unsqueeze(2)  # [seq, rows, 1, dim]


def build_policy(cfg: LoopConfig, device: torch.device, *, shape=None):
    """Megatron GPT + HF base weights + LoRA slot `cfg.slot` loaded from `cfg.init_adapter`,
    on `device`; with `cfg.full`, no LoRA: every weight trains. Returns (model, `GptShape`).

    The GPT is built and loaded on the host (`build_gpt` initialises on CPU), then moved to
    `device` before LoRA is attached, so the slot's factors and the adapter imported into it
    are made there.

    `shape`: a `GptShape` to build with random weights (seed `cfg.seed`) and a fresh slot
    instead of reading `cfg.hf_model` and `cfg.init_adapter` (tests on recorded rollouts).

    `cfg.attention == "tree"`: core attention reads the packed prefix tree directly
    (`art_megatron_ext.packing.tree_layer_spec`, no [S, S] mask; RoPE at each token's
    logical position via `enable_tree_attention`). `"dense"`: Megatron's local attention with
    the packer's dense tree mask and `LogicalRope` (fine at small S, O(S^2) memory)."""
    from art_megatron_ext.lora import attach_lora, import_peft
    from art_megatron_ext.lora.config import LoraConfig
    from art_megatron_ext.lora.hf_weights import load_hf_weights
    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt

    checkpoint = shape is None
    if checkpoint:
        shape = GptShape.from_hf_config(cfg.hf_model)
    torch.manual_seed(cfg.seed)
    spec = None
    if cfg.attention == "tree":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        from art_megatron_ext.packing import tree_layer_spec

        spec = tree_layer_spec(get_gpt_layer_local_spec(normalization="RMSNorm"))
    model = build_gpt(shape, max_sequence_length=cfg.seq_len, layer_spec=spec)
    if checkpoint:
        load_hf_weights(model, cfg.hf_model, shape)
    model = model.to(device)
    if not cfg.full:
        for p in model.parameters():
            p.requires_grad_(False)
        attach_lora(model, LoraConfig(rank=8, alpha=8.0, init_seed=cfg.seed, slot=cfg.slot))
        if checkpoint:
            import_peft(model, cfg.slot, cfg.init_adapter)
    if cfg.attention == "tree":
        from art_megatron_ext.packing import enable_tree_attention

        model = enable_tree_attention(model)
    else:
        model.rotary_pos_emb = LogicalRope(model.rotary_pos_emb)
    return model, shape


def data_parallel(model, cfg: LoopConfig):
    """(DDP wrapper, optimizer factory for `ResidentOptimizerStore.acquire`). Only the
    parameters that require grad (LoRA's, or every one with `cfg.full`) are in DDP's buffers
    and the optimizer; buckets of `cfg.bucket_size` elements (small: LoRA spans several bucket
    groups, as a large model's would)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model.config.calculate_per_token_loss = True  # DDP sums; finalize divides by the weight
    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(
            use_distributed_optimizer=True,
            overlap_grad_reduce=cfg.overlap,
            overlap_param_gather=cfg.overlap,
            grad_reduce_in_fp32=True,
            bucket_size=cfg.bucket_size,
        ),
        model,
    )
    config = OptimizerConfig(
        optimizer="adam",
        lr=cfg.learning_rate,
        weight_decay=0.0,
        clip_grad=0.0,
        use_distributed_optimizer=True,
        overlap_param_gather=cfg.overlap,
    )
    return ddp, lambda params: get_megatron_optimizer(config, [ddp])
