"""The fit check a staged adapter passes before anything is written (`slot_layout.check_fits`).

Each piece is one tensor as vLLM's `set_lora` would write it into one stacked tensor: a linear
layer's slot is `[max_loras, 1, rank, in]` (A) / `[max_loras, 1, out, rank]` (B), an expert
layer's `[max_loras, experts, rank, in]` / `[max_loras, experts, out, rank]`. A piece fits when
its leading dims (experts) equal the slot's, its rank is at most the slot's, its features
equal the slot's and its dtype is the slot's; otherwise the error names module, tensor and
what the slot takes (an adapter error: the update is refused, nothing written). The pieces of
real vLLM layers are checked end to end in `test_expert_adapter_update.py`.
"""

from __future__ import annotations

import pytest
import torch

from art_vllm_plugin.worker.slot_layout import LoraUpdateError, check_fits
from art_vllm_plugin.worker.slot_piece import Piece

MODULE = "model.layers.1.mlp.experts"


def _expert_a(experts: int, rank: int, dtype=torch.bfloat16) -> Piece:
    buffer = torch.zeros(2, 8, 8, 128, dtype=torch.bfloat16)
    tensor = torch.zeros(experts, rank, 128, dtype=dtype)
    return Piece("gate_proj (w1) lora_A", tensor, buffer, True, experts=True)


def _linear_b(out: int, rank: int) -> Piece:
    buffer = torch.zeros(2, 1, 64, 8, dtype=torch.bfloat16)
    return Piece("slice 1 lora_B", torch.zeros(out, rank, dtype=torch.bfloat16), buffer, False)


def test_pieces_that_fit_pass_and_a_smaller_rank_fits():
    check_fits(MODULE, [_expert_a(8, 8), _expert_a(8, 4)])
    check_fits("model.layers.0.self_attn.qkv_proj", [_linear_b(64, 8), _linear_b(64, 2)])


@pytest.mark.parametrize(
    ("piece", "message"),
    [
        (_expert_a(7, 8), "lora_A shape (7, 8, 128) does not fit the slot (experts 8, rank <= 8"),
        (_expert_a(8, 16), "lora_A shape (8, 16, 128) does not fit the slot (experts 8, rank <= 8"),
        (_expert_a(8, 8, torch.float32), "lora_A dtype torch.float32 differs from the slot's"),
        (_linear_b(32, 8), "lora_B shape (32, 8) does not fit the slot (rank <= 8, out_features"),
    ],
    ids=["expert-count", "expert-rank", "expert-dtype", "linear-out-features"],
)
def test_a_misfit_names_module_tensor_and_slot(piece, message):
    with pytest.raises(LoraUpdateError) as refused:
        check_fits(MODULE, [piece])
    assert message in str(refused.value)
    assert str(refused.value).startswith(f"{MODULE} {piece.label}: ")
    assert isinstance(refused.value, ValueError)  # staging reports it as the adapter's fault


def test_one_experts_tensor_for_an_expert_slot_does_not_fit():
    """A tensor without the expert dimension is refused, never written into expert 0 alone."""
    buffer = torch.zeros(2, 8, 8, 128, dtype=torch.bfloat16)
    tensor = torch.zeros(8, 128, dtype=torch.bfloat16)
    piece = Piece("gate_proj (w1) lora_A", tensor, buffer, True, experts=True)
    with pytest.raises(LoraUpdateError, match=r"shape \(8, 128\) does not fit the slot"):
        check_fits(MODULE, [piece])
