"""The attention mask that packed rows imply, from `subtree_end`.

Why one integer per token is enough: rows are laid out in depth-first preorder, so the
subtree of a token's segment is the contiguous range `[segment start, subtree_end)`. Query `i`
may see key `j` iff `j <= i` (causal) and `i < subtree_end[j]` (i lies in the subtree of j's
segment, i.e. j's segment is i's own segment or one of its ancestors). Padding tokens have
`subtree_end = j + 1`: they see only themselves, and nothing sees them.
"""

from __future__ import annotations

import torch


def tree_attention_mask(subtree_end: torch.Tensor) -> torch.Tensor:
    """`[..., seq]` subtree ends -> `[..., seq, seq]` bool mask, True where query i (dim -2)
    may attend to key j (dim -1). Dense (1 GiB per 32k row): meant for tests and small rows.
    Training reads `subtree_end` directly: `tree_attention.py` (the kernel) and `spec.py`
    (its Megatron core-attention module)."""
    seq = subtree_end.shape[-1]
    query = torch.arange(seq, device=subtree_end.device).unsqueeze(-1)
    key = torch.arange(seq, device=subtree_end.device).unsqueeze(0)
    return (key <= query) & (query < subtree_end.unsqueeze(-2))
