"""The toy verifiable task and GRPO group advantages (numpy only).

Task: given a prompt of random token ids, write completion tokens from a fixed target set
(every `target_every`-th id: 17 of the tiny model's 545 ids by default). Reward = share of
completion tokens in the set, in [0, 1]. A randomly initialised model starts near the set's
share of its sampling distribution (a few percent). The set is small on purpose: one shift of
the final hidden state toward the sum of the targets' output-embedding rows raises all of
them (random rows of a 128-wide model are nearly orthogonal), which LoRA learns in a few
dozen steps on CPU; a quarter of the vocabulary cannot be raised together that way. The
reward is computed from token ids alone (verifiable, no tokenizer).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class TargetTokenTask:
    def __init__(self, vocab_size: int, prompt_len: int, *, target_every: int = 4, first_id=3):
        """Ids below `first_id` (pad, bos, eos of the tiny model) never appear in prompts."""
        self.vocab_size = vocab_size
        self.prompt_len = prompt_len
        self.first_id = first_id
        self.targets = np.zeros(vocab_size, dtype=bool)
        self.targets[first_id::target_every] = True

    def prompt(self, rng: np.random.Generator) -> list[int]:
        return rng.integers(self.first_id, self.vocab_size, self.prompt_len).tolist()

    def reward(self, completion: Sequence[int]) -> float:
        ids = np.asarray(completion, dtype=np.int64)
        return float(self.targets[ids].mean()) if ids.size else 0.0


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> np.ndarray:
    """GRPO: each completion's reward relative to its group, in units of the group's std."""
    r = np.asarray(rewards, dtype=np.float64)
    return (r - r.mean()) / (r.std() + eps)
