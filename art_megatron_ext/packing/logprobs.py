"""Per-token logprobs of packed rows, read at each token's predecessor.

Why not `logits[:, :-1]` against `tokens[:, 1:]`: in a packed prefix tree a branch's first
token does not follow its parent physically; the logits that predict token `i` sit at
`predecessor[i]` (`pack.py`). Only the selected positions are normalised, and only
`chunk_tokens` of them at a time, straight from each tensor-parallel rank's vocabulary shard
(`vocab_parallel.py`): neither a `log_softmax` over `[rows, seq, vocab]` nor a
`[trained tokens, vocab]` tensor is ever made.

Sampling temperature: the logprobs a policy-gradient trainer compares with vLLM's are those of
the distribution vLLM sampled from, `log_softmax(logits.float() / T)` (its sampler upcasts the
logits to fp32, then divides by the request's temperature). So the temperature is applied
here, inside the chunk: each chunk of scored logits is upcast to fp32, divided by its tokens'
temperatures on the logits' device, then normalised. Dividing bf16 logits before (the
division rounded to bf16, and T itself rounded: 0.7 is 0.69921875) moves a logprob by up to
a few hundredths at logits of size 10 to 20, which is an importance ratio off by a few per
cent on a fresh token (tests/art_megatron_ext/packing/test_logprobs_temperature.py).
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from .vocab_parallel import DEFAULT_CHUNK_TOKENS, megatron_tp_group, vocab_parallel_logprobs


def predecessor_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    predecessor: torch.Tensor,
    mask: torch.Tensor,
    *,
    temperature: torch.Tensor | float | None = None,
    vocab_parallel: bool = True,
    tp_group=None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """`[rows, seq]` logprob of `tokens[r, i]` under `logits[r, predecessor[r, i]]` where `mask`
    is True (e.g. `PackedBatch.assistant_mask`), 0.0 elsewhere. Differentiable in `logits`.

    Args:
        logits: `[rows, seq, vocab / tp]`, this rank's vocabulary shard, as Megatron's
            GPTModel returns it by default (`parallel_output=True`): tensor-parallel rank `r`
            holds ids `[r * vocab/tp, (r + 1) * vocab/tp)`. At TP=1 (or with no Megatron
            parallel state) that is the whole vocabulary.
        tokens, predecessor: `[rows, seq]` integer, from the `PackedBatch`.
        mask: `[rows, seq]` bool, the positions to score.
        temperature: the sampling temperature the logits are divided by, in fp32 inside each
            chunk (module docstring): a float for every token, or a `[rows, seq]` tensor
            giving the temperature of the logits at each position (read at each scored
            token's predecessor, i.e. where its logits are; moved to the logits' device).
            None or 1.0: no division. Every temperature read must be finite and > 0.
        vocab_parallel: False when `logits` hold the whole vocabulary on every rank (gathered,
            e.g. GPTModel's `runtime_gather_output=True`): no communication then.
        tp_group: the group the vocabulary is split over; default Megatron's
            tensor-model-parallel group when its parallel state is initialized. Every rank
            of it must call this with the same batch.
        chunk_tokens: scored tokens normalised at once; the extra memory is a few
            `[chunk_tokens, vocab / tp]` fp32 tensors.
        vocab_size: the model's true vocabulary when Megatron padded the output layer
            (`vocab_parallel_logprobs`): padded ids take no probability. None: all columns.

    Returns fp32 (fp64 for fp64 logits) whatever the logits' dtype. Raises ValueError naming
    the first masked position whose predecessor is -1 (a trajectory's first token or
    padding: nothing predicts it), whose token is outside the vocabulary, or whose
    temperature is not a finite positive number.
    """
    rows, seq = tokens.shape
    if logits.dim() != 3 or logits.shape[:2] != (rows, seq) or predecessor.shape != (rows, seq):
        raise ValueError(
            f"logits {tuple(logits.shape)}, tokens {tuple(tokens.shape)} and predecessor "
            f"{tuple(predecessor.shape)} must share [rows, seq] (logits [rows, seq, vocab])"
        )
    if mask.shape != (rows, seq) or mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool [{rows}, {seq}], got {mask.dtype} {tuple(mask.shape)}")
    if not vocab_parallel and tp_group is not None:
        raise ValueError("tp_group was given with vocab_parallel=False: the logits are gathered")
    group = None
    if vocab_parallel:
        group = tp_group if tp_group is not None else megatron_tp_group()
    row, col = mask.to(logits.device).nonzero(as_tuple=True)
    source = predecessor.to(logits.device)[row, col].long()
    if bool((source < 0).any()):
        first = int((source < 0).nonzero()[0])
        raise ValueError(
            f"position ({int(row[first])}, {int(col[first])}) is masked but has predecessor -1 "
            "(a trajectory's first token or padding): no logits predict it"
        )
    target = tokens.to(logits.device)[row, col].long()
    ranks = 1 if group is None else torch.distributed.get_world_size(group)
    vocab = logits.shape[-1] * ranks if vocab_size is None else vocab_size
    outside = (target < 0) | (target >= vocab)
    if bool(outside.any()):
        first = int(outside.nonzero()[0])
        raise ValueError(
            f"position ({int(row[first])}, {int(col[first])}) holds token {int(target[first])}, "
            f"outside the vocabulary [0, {vocab}) of the logits ({ranks} shard(s) of "
            f"{logits.shape[-1]})"
        )
    scored = _scored_temperatures(temperature, logits, (row, col), source)
    if scored is None:
        values = vocab_parallel_logprobs(
            logits,
            (row, source),
            target,
            tp_group=group,
            chunk_tokens=chunk_tokens,
            vocab_size=vocab_size,
        )
    else:
        values = tempered_logprobs(
            logits,
            (row, source),
            target,
            scored,
            tp_group=group,
            chunk_tokens=chunk_tokens,
            vocab_size=vocab_size,
        )
    out = torch.zeros(rows, seq, dtype=values.dtype, device=logits.device)
    return out.index_put((row, col), values)


def _scored_temperatures(temperature, logits, where, source) -> torch.Tensor | None:
    """`[N]` temperature of each scored token's logits, in the logprobs' dtype on the logits'
    device; None when there is nothing to divide by (None, or the float 1.0)."""
    if temperature is None:
        return None
    wide = torch.promote_types(logits.dtype, torch.float32)
    row, col = where
    if not isinstance(temperature, torch.Tensor):
        t = float(temperature)
        if not (math.isfinite(t) and t > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
        if t == 1.0:
            return None
        return torch.full(row.shape, t, dtype=wide, device=logits.device)
    shape = tuple(logits.shape[:2])
    if tuple(temperature.shape) != shape or not temperature.is_floating_point():
        raise ValueError(
            f"temperature must be a float or a floating [rows, seq] = {list(shape)} tensor, got "
            f"{temperature.dtype} {list(temperature.shape)}"
        )
    scored = temperature.to(device=logits.device, dtype=wide)[row, source]
    bad = ~(torch.isfinite(scored) & (scored > 0))
    if bool(bad.any()):
        first = int(bad.nonzero()[0])
        raise ValueError(
            f"position ({int(row[first])}, {int(col[first])}) reads its logits at "
            f"({int(row[first])}, {int(source[first])}), whose temperature is "
            f"{float(scored[first])}: need a finite temperature > 0"
        )
    return scored


def tempered_logprobs(
    logits: torch.Tensor,
    index: tuple[torch.Tensor, ...],
    target: torch.Tensor,
    temperature: torch.Tensor,
    *,
    tp_group=None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """`[N]` logprob of `target[n]` under `logits[index][n] / temperature[n]`, the division
    done in fp32 (fp64 for fp64 logits) inside each chunk of `chunk_tokens` scored tokens.

    Args as `vocab_parallel_logprobs` (same checks, same collectives per chunk), plus
    `temperature`: `[N]` floating, > 0, one per scored token. Differentiable in `logits`;
    no `[N, vocab]` tensor is made. Backward recomputes each chunk's normalisation (one more
    pass over the chunk and, with TP, its all-reduces again; every rank of the group runs
    the same backward) instead of keeping fp32 copies of the scored logits.
    """
    n = target.shape[0]
    if temperature.shape != (n,) or not temperature.is_floating_point():
        raise ValueError(
            f"temperature must be a floating [{n}] tensor (one per target), got "
            f"{temperature.dtype} {tuple(temperature.shape)}"
        )
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    wide = torch.promote_types(logits.dtype, torch.float32)
    index = tuple(i.to(logits.device).long() for i in index)
    return _TemperedLogprobs.apply(
        logits,
        target.to(logits.device).long(),
        temperature.to(device=logits.device, dtype=wide),
        tp_group,
        chunk_tokens,
        vocab_size,
        *index,
    )


def _tempered_chunk(logits, index, target, temperature, group, vocab, a: int, b: int):
    """Chunk [a, b): (its scored logits upcast and divided by their temperatures, its
    logprobs). Under autograd when grad mode is on (backward's recompute)."""
    t = temperature[a:b, None]
    x = logits[tuple(i[a:b] for i in index)].to(t.dtype).div_(t)  # [c, shard], a copy
    if torch.is_grad_enabled():
        x.requires_grad_()
    rows = torch.arange(b - a, device=x.device)
    values = vocab_parallel_logprobs(
        x, (rows,), target[a:b], tp_group=group, chunk_tokens=b - a, vocab_size=vocab
    )
    return x, values


class _TemperedLogprobs(torch.autograd.Function):
    """Forward: per chunk, `vocab_parallel_logprobs` of the fp32 tempered chunk (no graph).
    Backward: per chunk, the same again with a graph; its gradient with respect to the
    tempered chunk, divided by the temperatures, goes into the logits' gradient at the
    chunk's positions (repeated positions accumulate)."""

    @staticmethod
    def forward(ctx, logits, target, temperature, group, chunk, vocab, *index):
        n = target.shape[0]
        out = torch.empty(n, dtype=temperature.dtype, device=logits.device)
        for a in range(0, n, chunk):
            b = min(a + chunk, n)
            out[a:b] = _tempered_chunk(logits, index, target, temperature, group, vocab, a, b)[1]
        ctx.group, ctx.chunk, ctx.vocab = group, chunk, vocab
        ctx.save_for_backward(logits, target, temperature, *index)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits, target, temperature, *index = ctx.saved_tensors
        logits = logits.detach()  # each chunk's recompute starts from a leaf copy
        grad = torch.zeros_like(logits)
        n = target.shape[0]
        for a in range(0, n, ctx.chunk):
            b = min(a + ctx.chunk, n)
            with torch.enable_grad():
                x, values = _tempered_chunk(
                    logits, index, target, temperature, ctx.group, ctx.vocab, a, b
                )
                (dx,) = torch.autograd.grad(values, x, grad_out[a:b].to(values.dtype))
            dx.div_(temperature[a:b, None])  # d(x / T) / dx
            grad.index_put_(tuple(i[a:b] for i in index), dx.to(grad.dtype), accumulate=True)
        return (grad, None, None, None, None, None, *([None] * len(index)))
