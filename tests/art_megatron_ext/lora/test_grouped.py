"""Grouped expert linears: one A/B pair per local expert, padded rank and expert rows.

Transformer Engine (whose grouped linears Megatron uses for experts) needs a GPU, so a small
stand-in with the same call shape, `forward(x, m_splits) -> (out, bias)` and `weight0..`,
plays the base layer. `SequentialMLP` experts (local spec) are real Megatron modules.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from support.decoder_layer import in_a_decoder_layer, with_experts
from support.fake_grouped import FakeColumnParallelGroupedLinear, FakeRowParallelGroupedLinear

from art_megatron_ext.lora import LoraConfig, attach_lora, iter_lora_sites, zero_lora_padding_
from art_megatron_ext.lora.export import export_peft
from art_megatron_ext.lora.grouped import grouped_linear, grouped_linear_ref
from art_megatron_ext.lora.padding import LOGICAL_SHAPE_ATTR, logical_view, padding_is_zero
from art_megatron_ext.lora.slot_ops import import_peft

HIDDEN, FFN, EXPERTS, RANK = 12, 10, 4, 3
SPLITS = [3, 0, 5, 2]  # tokens per expert, one expert empty


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    experts = torch.nn.Module()
    experts.num_local_experts = EXPERTS
    experts.linear_fc1 = FakeColumnParallelGroupedLinear(EXPERTS, HIDDEN, 2 * FFN)
    experts.linear_fc2 = FakeRowParallelGroupedLinear(EXPERTS, FFN, HIDDEN)
    model = with_experts(experts)
    attach_lora(model, LoraConfig(rank=RANK, alpha=6.0, targets=("linear_fc1", "linear_fc2")))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for e in iter_lora_sites(model):
            view = logical_view(e.adapter.b)
            view.copy_(torch.randn(view.shape, generator=g))
    return model


def _experts(model):
    return model.decoder.layers[0].mlp.experts


def _expert_mlp(model, x):
    experts = _experts(model)
    h, _ = experts.linear_fc1(x, SPLITS)
    gate, up = h.chunk(2, dim=-1)
    out, _ = experts.linear_fc2(F.silu(gate) * up, SPLITS)
    return out


def test_padded_shapes_pad_rank_and_expert_rows():
    entries = {e.path.rsplit(".", 1)[-1]: e for e in iter_lora_sites(_model())}
    fc1, fc2 = entries["linear_fc1"], entries["linear_fc2"]
    assert fc1.a_logical == (EXPERTS, RANK, HIDDEN) and fc1.a_padded == (EXPERTS, 16, HIDDEN)
    assert fc1.b_logical == (EXPERTS, 2 * FFN, RANK) and fc1.b_padded == (EXPERTS, 24, 16)
    assert fc2.a_logical == (EXPERTS, RANK, FFN) and fc2.a_padded == (EXPERTS, 16, FFN)
    assert fc2.b_logical == (EXPERTS, HIDDEN, RANK) and fc2.b_padded == (EXPERTS, 16, 16)


def test_grouped_delta_equals_one_lora_per_expert():
    model = _model()
    fc1 = _experts(model).linear_fc1
    x = torch.randn(sum(SPLITS), HIDDEN)
    adapter = fc1.lora.slots["default"]
    with torch.no_grad():
        base = FakeColumnParallelGroupedLinear.forward(fc1, x, SPLITS)[0]
        got = fc1(x, SPLITS)[0] - base
    a, b = logical_view(adapter.a), logical_view(adapter.b)
    want = torch.cat(
        [
            F.linear(F.linear(xe, a[e]), b[e]) * (6.0 / RANK)
            for e, xe in enumerate(torch.split(x, SPLITS))
        ]
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_grouped_mm_path_matches_the_per_expert_loop():
    x, w = torch.randn(sum(SPLITS), 16), torch.randn(EXPERTS, 24, 16)
    offs = torch.tensor(SPLITS).cumsum(0).to(torch.int32)
    torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)  # the fast path accepts these shapes
    torch.testing.assert_close(grouped_linear(x, w, SPLITS), grouped_linear_ref(x, w, SPLITS))


def test_adam_keeps_padded_expert_rows_and_rank_zero():
    model = _model()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=1e-2)
    for _ in range(3):
        _expert_mlp(model, torch.randn(sum(SPLITS), HIDDEN)).pow(2).sum().backward()
        for p in params:  # what a kernel computing whole padded tiles may leave behind
            noise = torch.randn_like(p)
            noise[tuple(slice(0, s) for s in getattr(p, LOGICAL_SHAPE_ATTR))] = 0
            p.grad.add_(noise)
        zero_lora_padding_(model, optimizer)
        optimizer.step()
        zero_lora_padding_(model, optimizer)
    for e in iter_lora_sites(model):
        for _, p in e.tensors:
            shape = getattr(p, LOGICAL_SHAPE_ATTR)
            assert padding_is_zero(p, shape) and padding_is_zero(p.grad, shape), e.path


def test_export_names_each_expert_and_splits_gate_up(tmp_path):
    model = _model()
    export_peft(model, "default", tmp_path, "tiny-moe")
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    assert len(tensors) == EXPERTS * 3 * 2
    fc1 = _experts(model).linear_fc1.lora.slots["default"]
    fc2 = _experts(model).linear_fc2.lora.slots["default"]
    for e in range(EXPERTS):
        key = f"base_model.model.model.layers.0.mlp.experts.{e}"
        b1 = logical_view(fc1.b)[e]
        assert torch.equal(tensors[f"{key}.gate_proj.lora_B.weight"], b1[:FFN])
        assert torch.equal(tensors[f"{key}.up_proj.lora_B.weight"], b1[FFN:])
        assert torch.equal(tensors[f"{key}.up_proj.lora_A.weight"], logical_view(fc1.a)[e])
        assert torch.equal(tensors[f"{key}.down_proj.lora_A.weight"], logical_view(fc2.a)[e])
        assert tuple(tensors[f"{key}.down_proj.lora_B.weight"].shape) == (HIDDEN, RANK)
    # and back: the same adapter loaded into another slot exports identically
    import_peft(model, "copy", tmp_path)
    export_peft(model, "copy", tmp_path / "again", "tiny-moe")
    again = load_file(tmp_path / "again" / "adapter_model.safetensors")
    assert all(torch.equal(again[k], tensors[k]) for k in tensors)


@pytest.fixture()
def moe_layer(megatron_world):
    from support.megatron_cpu import build_moe_layer, cpu_shim, moe_test_config

    with cpu_shim():
        torch.manual_seed(0)
        yield build_moe_layer(moe_test_config(num_moe_experts=4))


def test_sequential_mlp_experts_get_one_site_per_expert(moe_layer):
    from art_megatron_ext.lora import activate_slot

    sites = attach_lora(moe_layer, LoraConfig(rank=4, targets=("linear_fc1", "linear_fc2")))
    fc1 = [s for s in sites if s.info.target == "linear_fc1"]
    assert [s.info.expert_index for s in fc1] == [0, 1, 2, 3]
    assert all(s.info.kind == "column" and not s.info.explicit_expert_comm for s in fc1)
    for e in iter_lora_sites(moe_layer):
        logical_view(e.adapter.b).data.normal_()
    x = torch.randn(6, 1, 16)
    with torch.no_grad():
        with activate_slot(moe_layer, None):
            base, _ = moe_layer(x)
        adapted, _ = moe_layer(x)
    assert not torch.allclose(base, adapted)


def test_grouped_lora_runs_the_project_op_and_never_loops_silently():
    """float64 is not a grouped GEMM dtype: the op says so (the old path caught the kernel's
    error and looped over experts without a word)."""
    from art_megatron_ext.ops import GroupedGemmBackendError

    x, w = torch.randn(sum(SPLITS), 16, dtype=torch.float64), torch.randn(EXPERTS, 24, 16).double()
    with pytest.raises(GroupedGemmBackendError, match="float64"):
        grouped_linear(x, w, SPLITS)
    with pytest.raises(ValueError, match=r"sum to x\.shape"):  # counts checked, not looped over
        grouped_linear(x.float(), w.float(), [1, 1, 1, 1])


@pytest.fixture()
def art_moe_layer(megatron_world):
    from support.megatron_cpu import cpu_shim, moe_test_config

    from art_megatron_ext.moe import GroupedMLPOptions, art_moe_layer_spec

    with cpu_shim():
        torch.manual_seed(0)
        config = moe_test_config(
            num_moe_experts=4, gated_linear_unit=True, activation_func=F.silu
        )  # SwiGLU experts: fc1 exports as gate_proj + up_proj
        yield art_moe_layer_spec(4, GroupedMLPOptions("torch"))(config=config, layer_number=1)


def test_art_grouped_mlp_linears_are_grouped_lora_sites(art_moe_layer, tmp_path):
    """`ArtGroupedMLP` (our grouped experts) gets one grouped site per linear: the delta is one
    LoRA per expert, gradients reach A and B, and the export names every expert."""
    from art_megatron_ext.lora import activate_slot
    from art_megatron_ext.lora.grouped import GroupedLoraSite

    model = in_a_decoder_layer(art_moe_layer)
    sites = attach_lora(model, LoraConfig(rank=4, targets=("linear_fc1", "linear_fc2")))
    assert [type(s) for s in sites] == [GroupedLoraSite, GroupedLoraSite]
    fc1_site, fc2_site = sites
    assert (fc1_site.info.kind, fc2_site.info.kind) == ("grouped_column", "grouped_row")
    assert fc1_site.info.num_local_experts == 4
    assert fc1_site.info.gated
    assert fc1_site.info.expert_index == 0
    for e in iter_lora_sites(art_moe_layer):
        logical_view(e.adapter.b).data.normal_()
    experts = art_moe_layer.experts
    splits = torch.tensor([2, 0, 3, 1])
    x = torch.randn(6, experts.linear_fc1.weight.shape[1], requires_grad=True)
    with activate_slot(art_moe_layer, None):
        base, _ = experts.linear_fc1(x, splits)
    adapted, _ = experts.linear_fc1(x, splits)
    adapter = fc1_site.slots["default"]
    a, b = logical_view(adapter.a), logical_view(adapter.b)
    want = torch.cat([
        F.linear(F.linear(xe, a[e]), b[e]) * adapter.scaling
        for e, xe in enumerate(torch.split(x.detach(), splits.tolist()))
    ])  # fmt: skip
    torch.testing.assert_close(adapted.detach() - base.detach(), want, rtol=1e-5, atol=1e-5)
    out, _ = art_moe_layer(torch.randn(5, 1, 16))
    out.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for _, p in
               iter_lora_sites(art_moe_layer).__next__().tensors)  # fmt: skip
    assert experts.linear_fc1.weight.grad is None  # base frozen
    export_peft(model, "default", tmp_path, "tiny-moe")
    names = load_file(tmp_path / "adapter_model.safetensors")
    for e in range(4):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert any(f"experts.{e}.{proj}.lora_A" in k for k in names), (e, proj, list(names))
