"""One optimizer step of the trainer on this rank's packed rows (`trainer.py` calls it; so does
the on-device test, tests/examples/test_trainer_on_device.py, on recorded rollouts).

Forward at each group's sampling temperature, the GRPO objective (`grpo.py`), backward, DDP's
gradient reduce, `finalize_model_grads` dividing every gradient by the global batch's token
weight, one step of Megatron's distributed optimizer. Every tensor is on the device of the
packed batch (`batches.pack_for_step`), the model's: the token weight that
`finalize_model_grads` all-reduces included (NCCL takes device tensors only).
"""

from __future__ import annotations

import contextlib

from grpo import loss_terms, packed_logprobs
from loop_config import LoopConfig


def train_step(ddp, optimizer, packed, temperature, cfg: LoopConfig):
    """One optimizer step on this rank's rows; returns (logprobs, loss terms, global weight),
    all on the rows' device. Collective: DDP's gradient reduce-scatter, the weight's
    all-reduce, the optimizer's all-gather."""
    from megatron.core.distributed import finalize_model_grads

    from art_megatron_ext.lora import zero_lora_padding_
    from art_megatron_ext.lora.slots import activate_slot

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    # `--update full`: no LoRA slot, every weight trains
    with contextlib.nullcontext() if cfg.full else activate_slot(ddp.module, cfg.slot):
        lp = packed_logprobs(ddp, packed, cfg.attention, temperature)
        terms = loss_terms(lp, packed, cfg.clip_eps, cfg.tis_cap)
    terms.loss_sum.backward()
    weight = terms.weight_sum.clone()  # on the rows' device, as the all-reduce needs
    finalize_model_grads([ddp], num_tokens=weight)  # all-reduces `weight`, grads /= it
    zero_lora_padding_(ddp.module, optimizer)
    ok, _, _ = optimizer.step()
    if not ok:
        raise RuntimeError("the optimizer skipped its step (non-finite gradients)")
    zero_lora_padding_(ddp.module, optimizer)
    return lp, terms, weight
