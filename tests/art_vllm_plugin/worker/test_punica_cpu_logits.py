"""The 0.34 CPU lm_head LoRA wrapper (`worker/punica_cpu_logits.py`), on stand-ins for
`PunicaWrapperCPU`: sampled rows go through unchanged, prompt-logprob rows (a slice of the
step's hidden states) take their tokens' adapter indices, anything else is refused.

Why stand-ins: the wrapper only chooses which indices vLLM's own body reads
(`self.sampler_indices`); that the real body then serves is shown by the 0.34 server starting
at all (MRV2's warm-up runs prompt logprobs through it) in the serve suite.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from art_vllm_plugin.worker.punica_cpu_logits import LogitsRowsUnmapped, rows_by_token


def _recording():
    seen = []

    def add_lora_logits(self, y, x, lora_a, lora_b, scale, **kwargs):
        seen.append((self.sampler_indices.tolist(), x.shape[0]))

    return seen, rows_by_token(add_lora_logits)


def _wrapper(sampled: int, tokens: int):
    return SimpleNamespace(
        sampler_indices=torch.arange(sampled) + 100,
        token_lora_indices=torch.arange(tokens),
    )


def test_sampled_rows_pass_through_unchanged():
    seen, wrapped = _recording()
    self = _wrapper(sampled=2, tokens=6)
    wrapped(self, None, torch.zeros(2, 4), None, None, 1.0)
    assert seen == [([100, 101], 2)]


def test_a_chunk_of_the_steps_tokens_takes_their_indices():
    seen, wrapped = _recording()
    self = _wrapper(sampled=2, tokens=6)
    hidden = torch.zeros(6, 4)
    wrapped(self, None, hidden[:6], None, None, 1.0)
    wrapped(self, None, hidden[3:6], None, None, 1.0)
    assert seen == [([0, 1, 2, 3, 4, 5], 6), ([3, 4, 5], 3)]


def test_rows_that_are_no_slice_of_the_step_are_refused():
    _, wrapped = _recording()
    self = _wrapper(sampled=2, tokens=3)
    with pytest.raises(LogitsRowsUnmapped, match="neither the 2 sampled rows"):
        wrapped(self, None, torch.zeros(5, 4), None, None, 1.0)
