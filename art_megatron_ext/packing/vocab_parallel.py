"""Per-token logprobs from vocab-parallel logits, a chunk of tokens at a time.

Why: normalising gathered logits needs `[tokens, V]` in fp32 on one rank (a 122,880-token row
at a 150k vocabulary is 74 GB, twice over with the softmax autograd saves). Megatron's
`vocab_parallel_cross_entropy` shows the way round it: tensor-parallel rank `r` holds
vocabulary ids `[r * V/tp, (r + 1) * V/tp)`, and a token's log-sum-exp needs only three
numbers per shard (max, sum of exp, the target's logit), all-reduced over the group.

Unlike Megatron's function, which keeps an fp32 softmax of every token for backward, this
one works through the tokens `chunk_tokens` at a time and keeps only each token's fp32
log-sum-exp: backward recomputes a chunk's softmax from the logits (which the caller holds
anyway). Its extra memory is a few `[chunk_tokens, V/tp]` tensors in forward and in
backward, plus the logits-shaped gradient autograd needs in any case. Accumulation is fp32
(fp64 for fp64 logits), as in `log_softmax(logits.float())`.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

__all__ = ["DEFAULT_CHUNK_TOKENS", "megatron_tp_group", "vocab_parallel_logprobs"]

#: Tokens normalised at once. 1024 x 150k fp32 is 0.6 GB per intermediate at TP=1 (less by
#: the TP size), large enough to keep a GPU busy and few collectives per row.
DEFAULT_CHUNK_TOKENS = 1024


def megatron_tp_group():
    """Megatron's tensor-model-parallel group if its parallel state is initialized, else None.

    Reads `megatron.core.parallel_state` only if something already imported it: a process
    that never imported Megatron cannot have initialized it, and importing Megatron takes
    seconds (and is absent from some environments).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    state = sys.modules.get("megatron.core.parallel_state")
    if state is None or not state.model_parallel_is_initialized():
        return None
    return state.get_tensor_model_parallel_group()


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    index: tuple[torch.Tensor, ...],
    target: torch.Tensor,
    *,
    tp_group=None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """`[N]` logprob of vocabulary id `target[n]` under the logits at `logits[index][n]`.

    Differentiable in `logits`; no `[N, V]` tensor is made (see the module docstring).

    Args:
        logits: `[..., V/tp]` this rank's vocabulary shard (the whole vocabulary when
            `tp_group` is None or has one rank). Every rank's shard has the same width.
        index: one integer `[N]` tensor per leading dimension of `logits`, picking the
            logits vector of each scored token (repeats allowed: their gradients add up).
        target: `[N]` integer global vocabulary ids, the same on every rank.
        tp_group: the process group the vocabulary is split over, rank `r` holding ids
            `[r * V/tp, (r + 1) * V/tp)`; None: no split, no communication.
        chunk_tokens: tokens normalised at once (>= 1); bounds the extra memory.
        vocab_size: the model's true vocabulary when the logits are padded (Megatron pads the
            output layer to `make_vocab_size_divisible_by * tp`): ids `>= vocab_size` are no
            tokens and take no probability (the served model has no such column). None: every
            column is a token.

    Returns `[N]` in fp32, or in fp64 for fp64 logits. Every rank of `tp_group` must call
    this together with the same `N` (collectives). Raises ValueError naming the bad input.
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    if logits.dim() < 2 or len(index) != logits.dim() - 1:
        raise ValueError(
            f"index has {len(index)} tensors for logits of shape {tuple(logits.shape)}: "
            "give one per dimension before the vocabulary"
        )
    if target.dim() != 1 or target.is_floating_point():
        raise ValueError(
            f"target must be a 1-D integer tensor, got {target.dtype} {tuple(target.shape)}"
        )
    n = target.shape[0]
    for i, part in enumerate(index):
        if part.shape != (n,) or part.is_floating_point():
            raise ValueError(
                f"index[{i}] must be a 1-D integer tensor of the target's length {n}, got "
                f"{part.dtype} {tuple(part.shape)}"
            )
    group = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None
    shard = logits.shape[-1]
    ranks = 1 if group is None else dist.get_world_size(group)
    if group is not None:
        _check_same_on_every_rank(group, n, shard, logits.device)
    width = shard * ranks
    if vocab_size is not None and not (
        isinstance(vocab_size, int) and not isinstance(vocab_size, bool) and 0 < vocab_size <= width
    ):
        raise ValueError(
            f"vocab_size must be an int in [1, {width}] ({ranks} shard(s) of {shard} logits), "
            f"got {vocab_size!r}"
        )
    vocab = width if vocab_size is None else vocab_size
    if n and (int(target.min()) < 0 or int(target.max()) >= vocab):
        bad = int(((target < 0) | (target >= vocab)).nonzero()[0])
        raise ValueError(
            f"target[{bad}] = {int(target[bad])} is outside the vocabulary [0, {vocab}) "
            f"of {ranks} shard(s) of {shard} logits"
        )
    index = tuple(i.to(logits.device).long() for i in index)
    return _VocabParallelLogprobs.apply(
        logits, target.to(logits.device).long(), group, chunk_tokens, vocab, *index
    )


def _check_same_on_every_rank(group, n: int, shard: int, device: torch.device) -> None:
    """Fail fast instead of hanging: ranks disagreeing on N would call different numbers of
    collectives, and unequal shard widths would put vocabulary ids on the wrong rank."""
    sizes = torch.tensor([n, shard, -n, -shard], dtype=torch.int64, device=device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
    most, least = sizes[:2].tolist(), [-v for v in sizes[2:].tolist()]
    if most != least:
        raise ValueError(
            f"ranks of the tensor-parallel group disagree: tokens scored range over "
            f"[{least[0]}, {most[0]}], vocabulary shard widths over [{least[1]}, {most[1]}]; "
            "every rank must pass the same tokens and an equal shard of the logits"
        )


class _VocabParallelLogprobs(torch.autograd.Function):
    """Forward: per chunk, the shard's max (all-reduced MAX), then its sum of exp and target
    logit (one all-reduced SUM); keeps each token's log-sum-exp. Backward: per chunk,
    `d logp / d logit_v = [v == target] - softmax_v`, on this rank's columns only, so it
    needs no communication; repeated indices accumulate."""

    @staticmethod
    def forward(ctx, logits, target, group, chunk, vocab, *index):
        wide = torch.promote_types(logits.dtype, torch.float32)
        n, shard = target.shape[0], logits.shape[-1]
        start = 0 if group is None else dist.get_rank(group) * shard
        pad_from = max(0, vocab - start)  # this shard's first padded column (shard: none)
        out = torch.empty(n, dtype=wide, device=logits.device)
        lse = torch.empty(n, dtype=wide, device=logits.device)
        for a in range(0, n, chunk):
            b = min(a + chunk, n)
            x = logits[tuple(i[a:b] for i in index)].to(wide)  # [c, shard], a copy
            if pad_from < shard:
                x[:, pad_from:] = -torch.inf  # padded ids: probability 0
            if group is None:
                # log_softmax itself: bit-identical to normalising the gathered logits.
                lse[a:b] = torch.logsumexp(x, dim=-1)
                out[a:b] = x.log_softmax(-1).gather(-1, target[a:b, None]).squeeze(-1)
                continue
            local, inside = _local_ids(target[a:b], start, shard)
            picked = x.gather(-1, local[:, None]).squeeze(-1).masked_fill_(~inside, 0.0)
            top = x.amax(dim=-1)
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            total = x.sub_(top[:, None]).exp_().sum(dim=-1)  # x is our copy: in place
            stats = torch.stack([picked, total])
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
            out[a:b] = (stats[0] - top) - stats[1].log()
            lse[a:b] = top + stats[1].log()
        ctx.chunk, ctx.start, ctx.pad_from = chunk, start, pad_from
        ctx.save_for_backward(logits, target, lse, *index)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits, target, lse, *index = ctx.saved_tensors
        grad = torch.zeros_like(logits)
        shard, n = logits.shape[-1], target.shape[0]
        for a in range(0, n, ctx.chunk):
            b = min(a + ctx.chunk, n)
            where = tuple(i[a:b] for i in index)
            g = grad_out[a:b].to(lse.dtype)
            x = logits[where].to(lse.dtype)
            if ctx.pad_from < shard:
                x[:, ctx.pad_from :] = -torch.inf
            x.sub_(lse[a:b, None]).exp_().mul_(-g[:, None])  # -softmax * g
            local, inside = _local_ids(target[a:b], ctx.start, shard)
            rows = torch.arange(b - a, device=x.device)
            x[rows[inside], local[inside]] += g[inside]
            grad.index_put_(where, x.to(grad.dtype), accumulate=True)
        return (grad, None, None, None, None, *([None] * len(index)))


def _local_ids(target: torch.Tensor, start: int, shard: int):
    """Targets as column numbers of this shard (0 where another rank holds them), and
    whether this shard holds them."""
    local = target - start
    inside = (local >= 0) & (local < shard)
    return local.masked_fill(~inside, 0), inside
