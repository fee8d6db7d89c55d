"""Per-token logprobs of packed rows, read at each token's predecessor.

Why not `logits[:, :-1]` against `tokens[:, 1:]`: in a packed prefix tree a branch's first
token does not follow its parent physically; the logits that predict token `i` sit at
`predecessor[i]` (`pack.py`). Only the selected positions are normalised: a full
`log_softmax` over `[rows, seq, vocab]` would cost another logits-sized tensor.
"""

from __future__ import annotations

import torch


def predecessor_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    predecessor: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """`[rows, seq]` logprob of `tokens[r, i]` under `logits[r, predecessor[r, i]]` where `mask`
    is True (e.g. `PackedBatch.assistant_mask`), 0.0 elsewhere. Differentiable in `logits`.

    Args:
        logits: `[rows, seq, vocab]` full-vocabulary logits (gather a vocab-parallel output
            first: GPTModel's `runtime_gather_output=True`).
        tokens, predecessor: `[rows, seq]` integer, from the `PackedBatch`.
        mask: `[rows, seq]` bool, the positions to score.

    Raises ValueError naming the first masked position whose predecessor is -1 (a
    trajectory's first token or padding: nothing predicts it).
    """
    rows, seq = tokens.shape
    if logits.shape[:2] != (rows, seq) or predecessor.shape != (rows, seq):
        raise ValueError(
            f"logits {tuple(logits.shape)}, tokens {tuple(tokens.shape)} and predecessor "
            f"{tuple(predecessor.shape)} must share [rows, seq]"
        )
    if mask.shape != (rows, seq) or mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool [{rows}, {seq}], got {mask.dtype} {tuple(mask.shape)}")
    row, col = mask.to(logits.device).nonzero(as_tuple=True)
    source = predecessor.to(logits.device)[row, col].long()
    if bool((source < 0).any()):
        first = int((source < 0).nonzero()[0])
        raise ValueError(
            f"position ({int(row[first])}, {int(col[first])}) is masked but has predecessor -1 "
            "(a trajectory's first token or padding): no logits predict it"
        )
    wide = torch.promote_types(logits.dtype, torch.float32)  # fp32 at least, for bf16 logits
    picked = logits[row, source].to(wide).log_softmax(-1)
    target = tokens.to(logits.device)[row, col].long()
    values = picked.gather(-1, target[:, None]).squeeze(-1)
    out = torch.zeros(rows, seq, dtype=values.dtype, device=logits.device)
    return out.index_put((row, col), values)
