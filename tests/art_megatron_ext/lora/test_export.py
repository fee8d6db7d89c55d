"""PEFT export (split, unpadded, HF names) and import (PEFT -> slot -> export round trip)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from art_megatron_ext.lora import (
    SlotHasLiveGradients,
    activate_slot,
    iter_lora_sites,
    zero_lora_padding_,
)
from art_megatron_ext.lora.export import export_peft
from art_megatron_ext.lora.hf_layout import split_fused_b
from art_megatron_ext.lora.padding import padding_is_zero
from art_megatron_ext.lora.slot_ops import import_peft

PREFIX = "base_model.model.model.layers"


def test_export_writes_unpadded_hf_modules_and_config(make_lora_gpt, randomize_b, tmp_path):
    model = make_lora_gpt(rank=8, alpha=16.0)
    randomize_b(model, "default", seed=1)
    export_peft(model, "default", tmp_path, "tiny-llama")
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16.0 and config["peft_type"] == "LORA"
    assert config["base_model_name_or_path"] == "tiny-llama"
    assert config["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    assert len(tensors) == 2 * 7 * 2  # (A, B) x 7 modules x 2 layers
    shapes = {
        "self_attn.q_proj": ((8, 128), (128, 8)),
        "self_attn.k_proj": ((8, 128), (64, 8)),
        "self_attn.v_proj": ((8, 128), (64, 8)),
        "self_attn.o_proj": ((8, 128), (128, 8)),
        "mlp.gate_proj": ((8, 128), (256, 8)),
        "mlp.up_proj": ((8, 128), (256, 8)),
        "mlp.down_proj": ((8, 256), (128, 8)),
    }
    for layer in (0, 1):
        for module, (a_shape, b_shape) in shapes.items():
            key = f"{PREFIX}.{layer}.{module}"
            assert tuple(tensors[f"{key}.lora_A.weight"].shape) == a_shape, key
            assert tuple(tensors[f"{key}.lora_B.weight"].shape) == b_shape, key
    # q, k and v share the fused site's A
    q_a = tensors[f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"]
    assert torch.equal(q_a, tensors[f"{PREFIX}.0.self_attn.v_proj.lora_A.weight"])


def test_peft_to_slot_to_peft_round_trip_is_exact(make_lora_gpt, randomize_b, lm_loss, tmp_path):
    model = make_lora_gpt(rank=8, alpha=16.0)
    randomize_b(model, "default", seed=1)
    export_peft(model, "default", tmp_path / "first", "tiny")
    assert import_peft(model, "copy", tmp_path / "first") == 8
    export_peft(model, "copy", tmp_path / "second", "tiny")
    first = load_file(tmp_path / "first" / "adapter_model.safetensors")
    second = load_file(tmp_path / "second" / "adapter_model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    with torch.no_grad():
        default = lm_loss(model)
        with activate_slot(model, "copy"):
            copy = lm_loss(model)
    assert torch.equal(default, copy)


def test_fused_parts_with_their_own_a_load_stacked_and_round_trip(
    make_lora_gpt, randomize_b, tmp_path
):
    """A PEFT adapter whose q/k/v and gate/up each have their own A (as PEFT trains them)."""
    model = make_lora_gpt(rank=8, alpha=16.0)
    randomize_b(model, "default", seed=1)
    export_peft(model, "default", tmp_path, "tiny")
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    g = torch.Generator().manual_seed(3)
    for key in tensors:
        if "lora_A" in key and ("k_proj" in key or "up_proj" in key):
            tensors[key] = torch.randn(tensors[key].shape, generator=g) / 10
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    assert import_peft(model, "own", tmp_path) == 8
    qkv = model.decoder.layers[1].self_attention.linear_qkv.lora
    adapter = qkv.slots["own"]
    assert adapter.parts == 3 and adapter.rank == 8 and tuple(adapter.a.shape) == (32, 128)
    # the Megatron site computes each HF module's own LoRA
    x = torch.randn(4, 128)
    with torch.no_grad():
        q, k, v = split_fused_b(qkv.info, [qkv.delta(x, adapter).T])
    for part, name in zip((q, k, v), ("q_proj", "k_proj", "v_proj"), strict=True):
        a = tensors[f"{PREFIX}.1.self_attn.{name}.lora_A.weight"]
        b = tensors[f"{PREFIX}.1.self_attn.{name}.lora_B.weight"]
        torch.testing.assert_close(part.T, x @ a.T @ b.T * 2.0, rtol=1e-5, atol=1e-6)
    export_peft(model, "own", tmp_path / "again", "tiny")
    again = load_file(tmp_path / "again" / "adapter_model.safetensors")
    assert again.keys() == tensors.keys()
    assert all(torch.equal(again[k], tensors[k]) for k in tensors)


def test_stacked_slot_keeps_its_block_structure_under_adam(make_lora_gpt, lm_loss, tmp_path):
    """Off-block entries of a stacked B are structural zeros: they stay exactly 0."""
    model = make_lora_gpt()
    export_peft(model, "default", tmp_path, "tiny")
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    for key in tensors:
        if "lora_A" in key and "v_proj" in key:
            tensors[key] = tensors[key].flip(0)
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    import_peft(model, "own", tmp_path)
    params = [p for e in iter_lora_sites(model) if e.slot == "own" for _, p in e.tensors]
    optimizer = torch.optim.Adam(params, lr=1e-2)
    for step in range(2):
        with activate_slot(model, "own"):
            lm_loss(model, seed=step).backward()
        zero_lora_padding_(model, optimizer)
        optimizer.step()
        zero_lora_padding_(model, optimizer)
    b = model.decoder.layers[0].self_attention.linear_qkv.lora.slots["own"].b
    assert b.lora_zero_mask.any() and b.grad.abs().sum() > 0
    assert padding_is_zero(b, b.lora_logical_shape, b.lora_zero_mask)
    assert padding_is_zero(b.grad, b.lora_logical_shape, b.lora_zero_mask)
    assert b[~b.lora_zero_mask].abs().sum() > 0


def test_import_refuses_tensors_that_match_no_site(make_lora_gpt, tmp_path):
    model = make_lora_gpt()
    export_peft(model, "default", tmp_path, "tiny")
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    tensors[f"{PREFIX}.7.self_attn.o_proj.lora_A.weight"] = torch.zeros(8, 128)
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"match no LoRA site.*layers\.7"):
        import_peft(model, "other", tmp_path)


def test_import_into_a_slot_with_live_gradients_is_refused(make_lora_gpt, lm_loss, tmp_path):
    model = make_lora_gpt()
    export_peft(model, "default", tmp_path, "tiny")
    lm_loss(model).backward()
    with pytest.raises(SlotHasLiveGradients, match="'default'"):
        import_peft(model, "default", tmp_path)
    model.zero_grad(set_to_none=True)
    assert import_peft(model, "default", tmp_path) == 8


def test_import_of_a_subset_adapter_targets_only_its_modules(make_lora_gpt, lm_loss, tmp_path):
    """A q/v-only PEFT adapter: k gets a zero B, other sites do not hold the slot."""
    model = make_lora_gpt()
    export_peft(model, "default", tmp_path, "tiny")
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    keep = {k: v for k, v in tensors.items() if ".q_proj." in k or ".v_proj." in k}
    keep = {k: (v + 0.01 if "lora_B" in k else v) for k, v in keep.items()}
    save_file(keep, tmp_path / "adapter_model.safetensors")
    assert import_peft(model, "qv", tmp_path) == 2
    export_peft(model, "qv", tmp_path / "again", "tiny")
    again = load_file(tmp_path / "again" / "adapter_model.safetensors")
    assert {k for k in again if ".k_proj." not in k} == set(keep)
    assert not any(v.any() for k, v in again.items() if ".k_proj.lora_B" in k)
