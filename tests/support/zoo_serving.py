"""The dense model-zoo checkpoints vLLM serves in the zoo's serving test, and HF greedy
references. Serving side only (vLLM, transformers and peft in `.venv-serve`). Not collected
by pytest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Greedy:
    """Greedy tokens, each one's log-probability, and the gap between the best and
    second-best logit at each step."""

    tokens: list[int]
    logprobs: list[float]
    gaps: list[float]


def hf_greedy(model, prompt: list[int], n: int) -> Greedy:
    """`model.generate` greedy continuation of `prompt` (fp32, `n` tokens, no stop at EOS, as
    vLLM's `ignore_eos`), with log-probabilities from the raw logits (vLLM's default
    `raw_logprobs`)."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=0,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    assert len(tokens) == n, f"HF generated {len(tokens)} tokens, not {n}"
    logprobs, gaps = [], []
    for token, logits in zip(tokens, out.logits, strict=True):
        row = logits[0].double()
        logprobs.append(float(torch.log_softmax(row, dim=-1)[token]))
        top = torch.topk(row, 2).values
        gaps.append(float(top[0] - top[1]))
    return Greedy(tokens, logprobs, gaps)


def compared_prefix(gaps: list[float], tie_gap: float) -> int:
    """How many leading greedy tokens must agree: up to the first near tie (best and second
    logit closer than `tie_gap`, where fp32 sums in another order may pick the other)."""
    return next((i for i, gap in enumerate(gaps) if gap < tie_gap), len(gaps))
