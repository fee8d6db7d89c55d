"""LoRA on the logits rows of prompt logprobs, in vLLM 0.34's CPU build.

Why: in 0.34 (Model Runner V2, the only runner) `PunicaWrapperCPU.add_lora_logits` applies the
lm_head LoRA with `sampler_indices`, one adapter index per *sampled* row. Prompt logprobs
compute logits for every scheduled token instead (`compute_prompt_logprobs_with_chunking`, in
chunks of up to 1024 rows of the step's hidden states), and the row counts no longer match:
`einsum(): subscript b has size 128 ... 256`. MRV2's warm-up asks for prompt logprobs, so on
the CPU platform every `vllm serve --enable-lora` dies at start, plugin or not (measured
2026-12-07 with the tiny Llama, stock `vllm serve`). The CUDA wrapper maps those rows through
its own prompt mapping and is not touched.

The rows of such a call are a slice of the step's hidden states, one per scheduled token, so
their adapter indices are the per-token ones (`token_lora_indices`) over the same slice; where
the slice starts is read from the view's offset. A call whose rows match neither mapping is
refused with a message, never computed with the wrong adapter.

What this does not lift: a served request asking for prompt logprobs with `--enable-lora` on
CPU is still refused with 400 (`api_server/request_refusals.py`, as on 0.32, where the same
`einsum` mismatch takes EngineCore down); `api_server/test_prompt_logprobs.py` passes on 0.34
with those refusals. What runs through here is MRV2's warm-up, whose requests carry no adapter.

Scope: installed by `install.install_worker` on the CPU platform with vLLM 0.34 (declared
`checked` for 0.34 only).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace


class LogitsRowsUnmapped(RuntimeError):
    """A logits call whose rows are neither the sampled rows nor a slice of the step's tokens."""


def _token_slice(self, x):
    """The per-token adapter indices of the rows of `x`, a view into the step's hidden
    states, or None when `x` is not such a view."""
    tokens = self.token_lora_indices
    rows = x.view(-1, x.shape[-1]) if x.dim() != 2 else x
    if rows.dim() != 2 or rows.stride(-1) != 1 or rows.stride(0) != rows.shape[-1]:
        return None
    start = rows.storage_offset() // rows.stride(0)
    if start + rows.shape[0] > tokens.shape[0]:
        return None
    return tokens[start : start + rows.shape[0]]


def rows_by_token(add_lora_logits):
    """Wrapper for `PunicaWrapperCPU.add_lora_logits` (applied by `install`): sampled rows go
    through vLLM unchanged; prompt-logprob rows use their tokens' adapter indices."""

    @functools.wraps(add_lora_logits)
    def add_lora_logits_by_row(self, y, x, lora_a_stacked, lora_b_stacked, scale, **kwargs):
        rows = x.numel() // x.shape[-1]
        if rows == self.sampler_indices.shape[0]:
            return add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, **kwargs)
        indices = _token_slice(self, x)
        if indices is None:
            raise LogitsRowsUnmapped(
                f"lm_head LoRA on {rows} logits rows: neither the {self.sampler_indices.shape[0]}"
                f" sampled rows nor a slice of the step's {self.token_lora_indices.shape[0]} "
                "tokens (vLLM 0.34 CPU prompt logprobs); refused rather than computed with the "
                "wrong adapter"
            )
        # vLLM's body reads only `self.sampler_indices`: it runs unchanged on these rows.
        view = SimpleNamespace(sampler_indices=indices)
        return add_lora_logits(view, y, x, lora_a_stacked, lora_b_stacked, scale, **kwargs)

    return add_lora_logits_by_row
