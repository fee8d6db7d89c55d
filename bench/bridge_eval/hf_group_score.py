"""Score expert groups the way Hugging Face DeepseekV3 does (fix 3 in docs/model-mapping.md).

Why: megatron-core 0.19.2 `moe_utils.group_limited_topk` scores each expert group by the sum
of its top `topk // group_topk` scores; HF `DeepseekV3` (and DeepSeek's reference code) by
the sum of its top 2. They agree for DeepSeek-V3 itself (8 // 4 == 2), not for the zoo's tiny
config (2 // 2 == 1). `install()` replaces `moe_utils.group_limited_topk` by HF's rule, for
measurement only. Used by `run_bridge.py --fix --fix-group`; not run on its own.
"""

from __future__ import annotations

import torch

HF_GROUP_TOPK = 2  # experts per group summed into the group's score (HF, DeepSeek)


def group_limited_topk(scores, topk, num_tokens, num_experts, num_groups, group_topk):
    """Megatron's signature and result, with HF's group score."""
    group_scores = scores.view(num_tokens, num_groups, -1).topk(HF_GROUP_TOPK, dim=-1)[0]
    group_idx = torch.topk(group_scores.sum(dim=-1), k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros(num_tokens, num_groups, dtype=scores.dtype)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (
        group_mask.unsqueeze(-1)
        .expand(num_tokens, num_groups, num_experts // num_groups)
        .reshape(num_tokens, -1)
    )
    masked_scores = scores.masked_fill(~score_mask.bool(), float("-inf"))
    return torch.topk(masked_scores, k=topk, dim=-1)


def install() -> None:
    """Patch megatron-core's `moe_utils.group_limited_topk` in this process."""
    from megatron.core.transformer.moe import moe_utils

    moe_utils.group_limited_topk = group_limited_topk
