"""Per-token logprobs of packed rows, read at each token's predecessor.

Why not `logits[:, :-1]` against `tokens[:, 1:]`: in a packed prefix tree a branch's first
token does not follow its parent physically; the logits that predict token `i` sit at
`predecessor[i]` (`pack.py`). Only the selected positions are normalised, and only
`chunk_tokens` of them at a time, straight from each tensor-parallel rank's vocabulary shard
(`vocab_parallel.py`): neither a `log_softmax` over `[rows, seq, vocab]` nor a
`[trained tokens, vocab]` tensor is ever made.
"""

from __future__ import annotations

import torch

from .vocab_parallel import DEFAULT_CHUNK_TOKENS, megatron_tp_group, vocab_parallel_logprobs


def predecessor_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    predecessor: torch.Tensor,
    mask: torch.Tensor,
    *,
    vocab_parallel: bool = True,
    tp_group=None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
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
        vocab_parallel: False when `logits` hold the whole vocabulary on every rank (gathered,
            e.g. GPTModel's `runtime_gather_output=True`): no communication then.
        tp_group: the group the vocabulary is split over; default Megatron's
            tensor-model-parallel group when its parallel state is initialized. Every rank
            of it must call this with the same batch.
        chunk_tokens: scored tokens normalised at once; the extra memory is a few
            `[chunk_tokens, vocab / tp]` fp32 tensors.

    Returns fp32 (fp64 for fp64 logits) whatever the logits' dtype. Raises ValueError naming
    the first masked position whose predecessor is -1 (a trajectory's first token or
    padding: nothing predicts it) or whose token is outside the vocabulary.
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
    vocab = logits.shape[-1] * ranks
    outside = (target < 0) | (target >= vocab)
    if bool(outside.any()):
        first = int(outside.nonzero()[0])
        raise ValueError(
            f"position ({int(row[first])}, {int(col[first])}) holds token {int(target[first])}, "
            f"outside the vocabulary [0, {vocab}) of the logits ({ranks} shard(s) of "
            f"{logits.shape[-1]})"
        )
    values = vocab_parallel_logprobs(
        logits, (row, source), target, tp_group=group, chunk_tokens=chunk_tokens
    )
    out = torch.zeros(rows, seq, dtype=values.dtype, device=logits.device)
    return out.index_put((row, col), values)
