"""Named slots: load, activate, drop; live-gradient refusal; survival across recomputation."""

from __future__ import annotations

import pytest
import torch

from art_megatron_ext.lora import (
    NoActiveSlot,
    SlotHasLiveGradients,
    activate_slot,
    active_slot,
    iter_lora_sites,
)
from art_megatron_ext.lora.slot_ops import add_slot, drop_slot


def _lora_grads(model) -> dict[str, torch.Tensor]:
    return {
        f"{e.path}/{e.slot}/{n}": p.grad.clone()
        for e in iter_lora_sites(model)
        for n, p in e.tensors
        if p.grad is not None
    }


def test_fresh_slot_is_identity_and_none_means_base_model(make_lora_gpt, lm_loss, randomize_b):
    model = make_lora_gpt()
    with torch.no_grad():
        with activate_slot(model, None):
            base = lm_loss(model)
        fresh = lm_loss(model)  # default slot, B = 0
        randomize_b(model, "default", seed=1)
        trained = lm_loss(model)
        with activate_slot(model, None):
            base_again = lm_loss(model)
    assert torch.equal(fresh, base) and torch.equal(base_again, base)
    assert not torch.allclose(trained, base)


def test_slots_hold_independent_adapters(make_lora_gpt, lm_loss, randomize_b):
    model = make_lora_gpt()
    add_slot(model, "other", rank=4, alpha=4.0)
    randomize_b(model, "default", seed=1)
    randomize_b(model, "other", seed=2)
    with torch.no_grad():
        default = lm_loss(model)
        with activate_slot(model, "other"):
            other = lm_loss(model)
            with activate_slot(model, "default"):  # nesting: innermost wins
                inner = lm_loss(model)
            other_again = lm_loss(model)
    assert torch.equal(inner, default) and torch.equal(other_again, other)
    assert not torch.allclose(default, other)
    drop_slot(model, "other")
    with pytest.raises(KeyError, match="'other'"), activate_slot(model, "other"):
        pass


def test_loading_into_a_slot_with_live_gradients_is_refused(make_lora_gpt, lm_loss):
    model = make_lora_gpt()
    site = next(iter_lora_sites(model)).site
    lm_loss(model).backward()
    a, b = torch.ones(8, site.info.in_local), torch.ones(site.info.out_features, 8)
    before = site.slots["default"].a.detach().clone()
    with pytest.raises(SlotHasLiveGradients, match="slot 'default' still holds gradients"):
        site.load_slot("default", a, b, alpha=16.0)
    assert torch.equal(site.slots["default"].a, before)  # nothing changed
    model.zero_grad(set_to_none=True)
    same_param = site.slots["default"].a
    site.load_slot("default", a, b, alpha=16.0)
    assert site.slots["default"].a is same_param  # overwritten in place
    assert torch.equal(same_param[:8], a) and not same_param[8:].any()


def test_forward_without_a_choice_and_without_default_slot_is_refused(make_lora_gpt, lm_loss):
    model = make_lora_gpt(slot=None)
    add_slot(model, "policy", rank=8, alpha=16.0)
    with pytest.raises(NoActiveSlot, match="'policy'"):
        lm_loss(model)
    with activate_slot(model, "policy"):
        lm_loss(model)


def _grads_under_slot(model, slot, lm_loss, recompute: bool):
    model.decoder.config.recompute_granularity = "full" if recompute else None
    model.zero_grad(set_to_none=True)
    with activate_slot(model, slot):
        loss = lm_loss(model)
    loss.backward()  # outside the context, as a trainer's backward usually is
    return _lora_grads(model)


def test_active_slot_survives_activation_recomputation(make_lora_gpt, lm_loss, randomize_b):
    model = make_lora_gpt(recompute=True)
    add_slot(model, "policy", rank=8, alpha=16.0)
    randomize_b(model, "default", seed=1)
    randomize_b(model, "policy", seed=2)
    # the base stays frozen, as in LoRA training: gradients reach the recomputed layers
    # only because attach_lora marks the embedding output as requiring grad
    want = _grads_under_slot(model, "policy", lm_loss, recompute=False)
    got = _grads_under_slot(model, "policy", lm_loss, recompute=True)
    assert want.keys() == got.keys() and any("policy" in k for k in want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-7)


def test_recomputation_without_the_capture_uses_the_wrong_slot(
    make_lora_gpt, lm_loss, randomize_b, monkeypatch
):
    """Negative control: with the recompute capture removed the gradients change, so the
    test above exercises the capture."""
    model = make_lora_gpt(recompute=True)
    add_slot(model, "policy", rank=8, alpha=16.0)
    randomize_b(model, "default", seed=1)
    randomize_b(model, "policy", seed=2)
    want = _grads_under_slot(model, "policy", lm_loss, recompute=False)
    monkeypatch.setattr(active_slot, "_restore", lambda stack: None)
    got = _grads_under_slot(model, "policy", lm_loss, recompute=True)
    # the recomputed layers ran the default slot: its parameters got the gradients instead
    assert any("/default/" in k for k in got) and not any("/default/" in k for k in want)
    assert set(want) - set(got)
