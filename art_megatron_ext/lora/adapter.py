"""One adapter (one slot) at one LoRA site: the padded A and B parameters and the scaling."""

from __future__ import annotations

import torch

from .padding import logical_shape, padded_parameter


class LoraAdapter(torch.nn.Module):
    """Padded `a` ([.., r_pad, in]) and `b` ([.., out, r_pad]) of one slot; delta = b a x * s.

    `rank` and `alpha` are logical (PEFT) values; the scaling is alpha / rank whatever the
    padding. Both parameters carry `lora_logical_shape`.

    `parts` > 1 (fused sites only: q/k/v, gate/up) means each fused part has its own A, as
    PEFT adapters usually do: `a` stacks them ([parts * rank, in]) and `b` is block-diagonal
    (a part's output rows use only its own rank block). The off-block entries of `b` are
    structural zeros, recorded as `b.lora_zero_mask` and kept at 0 like padding.
    """

    def __init__(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        *,
        rank: int,
        alpha: float,
        a_padded: tuple[int, ...],
        b_padded: tuple[int, ...],
        parts: int = 1,
        b_zero_mask: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.rank = int(rank)
        self.alpha = float(alpha)
        self.parts = int(parts)
        self.a = padded_parameter(a, a_padded)
        self.b = padded_parameter(b, b_padded)
        if b_zero_mask is not None:
            self.b.lora_zero_mask = b_zero_mask.to(self.b.device)

    def forward(self) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
        """`(a, b)` themselves (no copy). Sites read the factors by calling the adapter so that
        its forward pre-hooks run first: under Megatron DDP with `overlap_param_gather` that
        hook waits for the all-gather bringing the other DP ranks' shards (`param_sync`)."""
        return self.a, self.b

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def parameters_with_shapes(self):
        """(name, parameter, logical shape) for `a` and `b`."""
        return [("a", self.a, logical_shape(self.a)), ("b", self.b, logical_shape(self.b))]

    def holds_live_gradients(self) -> bool:
        """True if a backward left gradients here that an optimizer step has not consumed.

        `.grad` set, or a non-zero Megatron-DDP `main_grad` buffer.
        """
        for p in (self.a, self.b):
            if p.grad is not None:
                return True
            main_grad = getattr(p, "main_grad", None)
            if main_grad is not None and bool(main_grad.count_nonzero()):
                return True
        return False

    def extra_repr(self) -> str:
        shapes = f"a={tuple(self.a.shape)}, b={tuple(self.b.shape)}"
        parts = f", parts={self.parts}" if self.parts > 1 else ""
        return f"rank={self.rank}, alpha={self.alpha}{parts}, {shapes}"
