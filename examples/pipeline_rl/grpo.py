"""The loop's policy-gradient objective: GRPO with a correction for stale tokens (torch).

In Pipeline RL a token may have been sampled by an older policy than the trainer's (its age,
from the span). Following decoupled PPO (Hilton et al. 2022; AReaL) the objective separates
the two roles PPO gives the "old" policy:

- the behaviour policy (what sampled the token: the server's logprob, at the request's
  temperature) only enters as an importance weight, truncated at `tis_cap` (TIS): a stale
  token's weight pi_prox / pi_behav cannot blow up the gradient;
- the clipping is anchored at the proximal policy (the trainer's weights before this step),
  so the trust region is around where the trainer is, not around a policy possibly many
  versions back.

Per trained token t with advantage A:
    w_t   = min(pi_prox(t) / pi_behav(t), tis_cap)           (no gradient)
    r_t   = pi_theta(t) / pi_prox(t)
    obj_t = w_t * min(r_t * A, clip(r_t, 1 - eps, 1 + eps) * A)
The loss is -sum(obj_t * weight_t) over the tokens of the whole global batch, divided by the
global sum of weights (`loss_terms` returns the local sums; the trainer normalises over the
data-parallel group). With one optimizer step per batch, as here, pi_prox is the trainer's
logprob detached (r_t = 1 in value, the clip inactive, the gradient that of w_t * A * log
pi_theta); a trainer taking several minibatch steps per batch computes pi_prox once, without
gradient, before the first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossTerms:
    loss_sum: torch.Tensor  # -sum(obj * weight) over this rank's trained tokens (has grad)
    weight_sum: torch.Tensor  # sum(weight) over them (float, no grad)
    tis_truncated: torch.Tensor  # trained tokens whose importance weight was truncated


def packed_logprobs(model, packed, attention: str, temperature: torch.Tensor) -> torch.Tensor:
    """[rows, seq] logprob of every token under the model at its group's sampling temperature,
    read at its predecessor's logits (0 where a token is not trained: prompt tokens, padding,
    tokens too stale to train). `temperature` is [rows, seq] on the rows' device: each
    position's group's temperature (1 on padding); a token's logits are divided by the
    temperature at its predecessor's position, which belongs to the same group. The division
    happens in fp32 inside the chunked normalisation (`predecessor_logprobs(temperature=)`),
    after the logits are upcast, as vLLM's sampler does: dividing bf16 logits first would
    round the quotient to bf16."""
    from art_megatron_ext.packing import predecessor_logprobs

    if attention == "tree":
        from art_megatron_ext.packing import TreePackedSeqParams

        params = TreePackedSeqParams.from_batch(packed)
        logits = model(packed.tokens, packed.input_pos, None, packed_seq_params=params)
    else:
        from art_megatron_ext.packing import tree_attention_mask

        blocked = ~tree_attention_mask(packed.subtree_end.long())[:, None]  # True = masked
        model.module.rotary_pos_emb.positions = packed.input_pos
        logits = model(packed.tokens, packed.input_pos, blocked)  # [rows, seq, vocab]
    return predecessor_logprobs(
        logits,
        packed.tokens,
        packed.predecessor,
        packed.assistant_mask,
        temperature=temperature,
    )


def loss_terms(
    lp: torch.Tensor,
    packed,
    clip_eps: float,
    tis_cap: float,
    proximal: torch.Tensor | None = None,
) -> LossTerms:
    """This rank's sums of the objective above (shared tokens carry summed weights).
    `proximal`: the trainer's logprobs before the batch's first step (None: `lp` detached,
    right for the first and only step on a batch)."""
    mask = packed.assistant_mask
    behaviour = torch.nan_to_num(packed.logprobs, nan=0.0)
    proximal = lp.detach() if proximal is None else proximal.detach()
    behaviour_weight = torch.exp(proximal - behaviour)  # pi_prox / pi_behav, untruncated
    tis = behaviour_weight.clamp(max=tis_cap)
    ratio = torch.exp(lp - proximal)
    adv = packed.advantages
    objective = tis * torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    w = packed.weights * mask
    weight_sum = w.sum().detach()
    return LossTerms(
        loss_sum=-(objective * w).sum(),
        weight_sum=weight_sum,
        tis_truncated=((behaviour_weight > tis_cap) & mask).sum(),
    )


def temperature_grid(packed, temperatures: list[float], device=None) -> torch.Tensor:
    """[rows, seq] float32 on `device` (default the host): trajectory k's positions
    (`packed.trajectory_positions[k]`) get `temperatures[k]`; positions of no trajectory
    (padding) get 1. Built on the host from the host-side positions, then moved in one copy."""
    grid = torch.ones(tuple(packed.tokens.shape), dtype=torch.float32)
    if len(temperatures) != len(packed.trajectory_positions):
        raise ValueError(
            f"{len(temperatures)} temperatures for {len(packed.trajectory_positions)} trajectories"
        )
    for (row, pos), temp in zip(packed.trajectory_positions, temperatures, strict=True):
        grid[row, torch.as_tensor(pos)] = float(temp)
    return grid if device is None else grid.to(device)
