"""Padded LoRA tensors: shapes recorded, one iterator over all of them, padding kept at 0."""

from __future__ import annotations

import torch

from art_megatron_ext.lora import activate_slot, iter_lora_sites, zero_lora_padding_
from art_megatron_ext.lora.padding import LOGICAL_SHAPE_ATTR, padding_is_zero
from art_megatron_ext.lora.slot_ops import add_slot


def _lora_params(model):
    return [p for p in model.parameters() if hasattr(p, LOGICAL_SHAPE_ATTR)]


def _scribble_on_padding_(model) -> None:
    """Write non-zero values into every padded gradient element (what a grouped GEMM that
    computes whole padded tiles, or a bug, leaves behind)."""
    for entry in iter_lora_sites(model):
        for _, p in entry.tensors:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            noise = torch.randn_like(p)
            noise[tuple(slice(0, s) for s in getattr(p, LOGICAL_SHAPE_ATTR))] = 0
            p.grad.add_(noise)


def _train(model, slots, steps, optimizer, cleanup: bool, lm_loss) -> None:
    for step in range(steps):
        for i, slot in enumerate(slots):
            with activate_slot(model, slot):
                lm_loss(model, seed=step * 10 + i).backward()
        _scribble_on_padding_(model)
        if cleanup:
            zero_lora_padding_(model, optimizer)
        optimizer.step()
        if cleanup:
            zero_lora_padding_(model, optimizer)


def test_iterator_yields_every_slot_with_logical_and_padded_shapes(make_lora_gpt):
    model = make_lora_gpt(rank=8)
    add_slot(model, "dyn4", rank=4, alpha=8.0)
    add_slot(model, "dyn20", rank=20, alpha=8.0)
    entries = list(iter_lora_sites(model))
    assert len(entries) == 3 * 8  # 3 slots x (qkv, proj, fc1, fc2) x 2 layers
    padded_rank = {"default": 16, "dyn4": 16, "dyn20": 32}
    logical_rank = {"default": 8, "dyn4": 4, "dyn20": 20}
    for e in entries:
        assert e.a_logical[0] == logical_rank[e.slot] and e.a_padded[0] == padded_rank[e.slot]
        assert e.b_logical[1] == logical_rank[e.slot] and e.b_padded[1] == padded_rank[e.slot]
        assert e.a_logical[1] == e.a_padded[1] and e.b_logical[0] == e.b_padded[0]
    qkv = next(e for e in entries if e.path.endswith("layers.0.self_attention.linear_qkv"))
    assert qkv.b_logical == (128 + 2 * 2 * 32, 8) and qkv.a_logical == (8, 128)
    # every parameter tagged with a logical shape is reached by the iterator, and nothing else
    reached = {id(p) for e in entries for _, p in e.tensors}
    assert reached == {id(p) for p in _lora_params(model)}
    assert reached == {id(p) for p in model.parameters() if p.requires_grad}


def test_adam_steps_leave_every_padded_element_zero_in_every_slot(make_lora_gpt, lm_loss):
    model = make_lora_gpt(rank=8)
    optimizer_params = _lora_params(model)
    add_slot(model, "dyn", rank=4, alpha=8.0)  # a dynamic slot added after the first one
    before = {id(p): p.detach().clone() for p in _lora_params(model)}
    optimizer = torch.optim.Adam(_lora_params(model), lr=1e-2, weight_decay=0.01)
    assert len(optimizer_params) < len(_lora_params(model))
    _train(model, ["default", "dyn"], 3, optimizer, cleanup=True, lm_loss=lm_loss)
    for e in iter_lora_sites(model):
        for _, p in e.tensors:
            shape = getattr(p, LOGICAL_SHAPE_ATTR)
            assert padding_is_zero(p, shape), f"{e.path}/{e.slot} parameter padding"
            assert padding_is_zero(p.grad, shape), f"{e.path}/{e.slot} gradient padding"
            for state in optimizer.state[p].values():
                if state.shape == p.shape:
                    assert padding_is_zero(state, shape), f"{e.path}/{e.slot} Adam state"
    # and both slots did train (their B moved off zero)
    for slot in ("default", "dyn"):
        moved = [
            not torch.equal(p, before[id(p)])
            for e in iter_lora_sites(model)
            if e.slot == slot
            for _, p in e.tensors
        ]
        assert all(moved), slot


def test_without_cleanup_padded_parameters_drift(make_lora_gpt, lm_loss):
    """The negative control: the same run without `zero_lora_padding_` breaks the invariant,
    so the test above can fail."""
    model = make_lora_gpt(rank=8)
    add_slot(model, "dyn", rank=4, alpha=8.0)
    optimizer = torch.optim.Adam(_lora_params(model), lr=1e-2)
    _train(model, ["default", "dyn"], 1, optimizer, cleanup=False, lm_loss=lm_loss)
    dirty = [
        e.slot
        for e in iter_lora_sites(model)
        for _, p in e.tensors
        if not padding_is_zero(p, getattr(p, LOGICAL_SHAPE_ATTR))
    ]
    assert set(dirty) == {"default", "dyn"}
