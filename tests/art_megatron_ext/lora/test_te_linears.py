"""LoRA on the Transformer Engine linears Megatron's TE specs build, on CPU.

TE needs a GPU, so `support/te_standin.py` stands in for Megatron 0.19's TE wrappers (same
class names, attributes and forward contract; its docstring says what it reproduces) and
Megatron's own `get_gpt_layer_with_transformer_engine_spec` lays the model out with it. The
extension recognizes the wrappers by class name and attributes only (never imports TE).
The real-TE twin of these tests is `test_te_real_gpu.py` (marked `gpu`).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from support.hf_tiny import random_llama_checkpoint
from support.te_standin import (
    TELayerNormColumnParallelLinear,
    TELinear,
    te_standin_layer_spec,
)

from art_megatron_ext.lora import (
    LoraConfig,
    UnsupportedLinear,
    activate_slot,
    attach_lora,
    iter_lora_sites,
    zero_lora_padding_,
)
from art_megatron_ext.lora.export import export_peft
from art_megatron_ext.lora.hf_weights import load_hf_weights
from art_megatron_ext.lora.padding import logical_view
from art_megatron_ext.lora.site import seeded_generator
from art_megatron_ext.lora.tiny_gpt import build_gpt


def _seed_b_(model) -> None:
    """B of every site from its stable name: the same values in both specs."""
    with torch.no_grad():
        for entry in iter_lora_sites(model):
            b = logical_view(entry.adapter.b)
            b.copy_(torch.randn(b.shape, generator=seeded_generator(5, entry.site.info.stable_key)))
            b.mul_(0.05)


def _tokens(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 256, (2, 13), generator=g)


def _logits(model, tokens):
    from art_megatron_ext.lora.cpu_runtime import causal_mask

    seq = tokens.shape[1] - 1
    positions = torch.arange(seq).expand(tokens.shape[0], seq)
    return model(tokens[:, :-1], positions, causal_mask(seq))


def _train_and_export(model, out: Path) -> list[torch.Tensor]:
    from art_megatron_ext.lora.cpu_runtime import causal_mask

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=1e-2)
    for step in range(2):
        tokens = _tokens(step)
        positions = torch.arange(12).expand(2, 12)
        loss = model(tokens[:, :-1], positions, causal_mask(12), labels=tokens[:, 1:]).mean()
        loss.backward()
        zero_lora_padding_(model, optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        zero_lora_padding_(model, optimizer)
    export_peft(model, "default", out, "tiny")
    return [_logits(model, _tokens(9)).detach()]


@pytest.fixture()
def twin_models(megatron_world, tiny_shape, tmp_path):
    """The tiny GPT with the local spec and with the TE (stand-in) spec, same HF weights,
    LoRA attached identically."""
    hf_dir = random_llama_checkpoint(tiny_shape, tmp_path / "hf")
    models = {}
    for spec in ("local", "te"):
        torch.manual_seed(0)
        layer_spec = te_standin_layer_spec() if spec == "te" else None
        model = build_gpt(tiny_shape, layer_spec=layer_spec)
        load_hf_weights(model, hf_dir, tiny_shape)
        attach_lora(model, LoraConfig(rank=8, alpha=16.0))
        _seed_b_(model)
        models[spec] = model
    return models


def test_every_te_linear_of_the_dense_spec_gets_a_site(twin_models):
    model = twin_models["te"]
    layer = model.decoder.layers[0]
    assert type(layer.self_attention.linear_qkv).__name__ == "TELayerNormColumnParallelLinear"
    assert type(layer.mlp.linear_fc2).__name__ == "TERowParallelLinear"
    sites = {e.path.split("layers.0.")[-1]: e.site.info for e in iter_lora_sites(model)}
    assert {k: (v.kind, v.layernorm_input) for k, v in sites.items() if "layers." not in k} == {
        "self_attention.linear_qkv": ("column", True),
        "self_attention.linear_proj": ("row", False),
        "mlp.linear_fc1": ("column", True),
        "mlp.linear_fc2": ("row", False),
    }


def test_te_spec_matches_the_local_spec_forward_training_and_export(twin_models, tmp_path):
    """Same weights, same LoRA: the TE-spec model computes the local-spec model's logits with
    and without LoRA, trains the same adapter and exports the same PEFT directory. The
    layernorm-fused linears must feed LoRA the normalized input for this to hold."""
    local, te = twin_models["local"], twin_models["te"]
    tokens = _tokens(0)
    with torch.no_grad(), activate_slot(local, None), activate_slot(te, None):
        torch.testing.assert_close(_logits(te, tokens), _logits(local, tokens), rtol=0, atol=0)
    with torch.no_grad():
        with_lora = _logits(te, tokens)
        torch.testing.assert_close(with_lora, _logits(local, tokens), rtol=0, atol=0)
        with activate_slot(te, None):
            assert (with_lora - _logits(te, tokens)).abs().max() > 1e-3  # LoRA changes outputs
    after_local = _train_and_export(local, tmp_path / "local")
    after_te = _train_and_export(te, tmp_path / "te")
    torch.testing.assert_close(after_te[0], after_local[0], rtol=0, atol=0)
    want = load_file(tmp_path / "local" / "adapter_model.safetensors")
    got = load_file(tmp_path / "te" / "adapter_model.safetensors")
    assert got.keys() == want.keys() and len(want) == 2 * 2 * 7
    assert all(torch.equal(got[k], want[k]) for k in want)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (tmp_path / "te" / name).read_bytes() == (tmp_path / "local" / name).read_bytes()


def test_layernorm_fused_lora_reads_the_normalized_input(twin_models):
    te = twin_models["te"]
    qkv = te.decoder.layers[0].self_attention.linear_qkv
    adapter = qkv.lora.slots["default"]
    x = torch.randn(12, 2, qkv.in_features)
    with torch.no_grad():
        with activate_slot(te, None):
            base, bias = qkv(x)
        out, bias_with_lora = qkv(x)
    assert bias is None and bias_with_lora is None  # the hook returns (out, bias), no ln_out
    normed = F.rms_norm(x, (x.shape[-1],), qkv.layer_norm_weight, qkv.eps)
    a, b = logical_view(adapter.a), logical_view(adapter.b)
    want = F.linear(F.linear(normed, a) * adapter.scaling, b)
    torch.testing.assert_close(out - base, want, rtol=1e-5, atol=1e-6)
    raw = F.linear(F.linear(x, a) * adapter.scaling, b)
    assert (raw - want).abs().max() > 1e-2  # the raw input would give another delta


def _config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        use_cpu_initialization=True,
        normalization="RMSNorm",
        add_bias_linear=True,
        gated_linear_unit=False,
    )
    return TransformerConfig(**{**base, **overrides})


def _holder(target: str, module: torch.nn.Module) -> torch.nn.Module:
    holder = torch.nn.Module()
    holder.mlp = torch.nn.Module()
    setattr(holder.mlp, target, module)
    return holder


@pytest.mark.parametrize("skip_bias_add", [False, True])
def test_layernorm_linear_with_bias_keeps_the_wrapper_contract(megatron_world, skip_bias_add):
    """With a bias TE returns (out, bias, ln_out) or adds the bias and returns (out, ln_out);
    either way the hooked wrapper returns Megatron's (out, bias-or-None)."""
    config = _config()
    linear = TELayerNormColumnParallelLinear(
        16,
        24,
        config=config,
        init_method=config.init_method,
        gather_output=False,
        bias=True,
        skip_bias_add=skip_bias_add,
        is_expert=False,
    )
    with torch.no_grad():
        linear.bias.normal_()
    model = _holder("linear_fc1", linear)
    attach_lora(model, LoraConfig(rank=4, alpha=4.0, targets=("linear_fc1",)))
    _seed_b_(model)
    x = torch.randn(5, 1, 16)
    with torch.no_grad():
        with activate_slot(model, None):
            base, base_bias = linear(x)
        out, bias = linear(x)
    assert (bias is linear.bias) == skip_bias_add and (base_bias is linear.bias) == skip_bias_add
    adapter = linear.lora.slots["default"]
    normed = F.rms_norm(x, (16,), linear.layer_norm_weight, linear.eps)
    a, b = logical_view(adapter.a), logical_view(adapter.b)
    want = F.linear(F.linear(normed, a) * adapter.scaling, b)
    torch.testing.assert_close(out - base, want, rtol=1e-5, atol=1e-6)


def test_layernorm_output_already_returned_is_refused(megatron_world):
    config = _config(add_bias_linear=False)
    linear = TELayerNormColumnParallelLinear(
        16,
        24,
        config=config,
        init_method=config.init_method,
        gather_output=False,
        bias=False,
        skip_bias_add=False,
        is_expert=False,
    )
    linear.return_layernorm_output = True
    with pytest.raises(UnsupportedLinear, match="already returns its layernorm output"):
        attach_lora(_holder("linear_fc1", linear), LoraConfig(targets=("linear_fc1",)))
    assert not hasattr(linear, "lora")


def test_duplicated_te_linear_is_refused_naming_it(megatron_world):
    config = _config(add_bias_linear=False)
    linear = TELinear(
        16,
        24,
        parallel_mode="duplicated",
        config=config,
        init_method=config.init_method,
        bias=False,
        skip_bias_add=False,
        skip_weight_param_allocation=False,
    )
    with pytest.raises(UnsupportedLinear, match=r"mlp\.linear_fc1: TELinear .*'duplicated'"):
        attach_lora(_holder("linear_fc1", linear), LoraConfig(targets=("linear_fc1",)))


def test_unsupported_linear_error_names_what_is_supported(megatron_world):
    """The old message suggested 'a TE spec without layernorm fused into the linear', which
    Megatron does not offer; the message now lists the linears LoRA wraps."""
    plain = torch.nn.Linear(16, 24)
    plain.config = SimpleNamespace(gated_linear_unit=False)
    with pytest.raises(UnsupportedLinear) as error:
        attach_lora(_holder("linear_fc1", plain), LoraConfig(targets=("linear_fc1",)))
    message = str(error.value)
    assert message.startswith("mlp.linear_fc1: Linear is not a linear LoRA can wrap")
    assert "without layernorm fused" not in message
    for name in (
        "ColumnParallelLinear",
        "TEColumnParallelLinear",
        "TERowParallelLinear",
        "TELayerNormColumnParallelLinear",
        "TEColumnParallelGroupedLinear",
    ):
        assert name in message


@pytest.mark.parametrize("grouped", [True, False])
def test_moe_te_spec_experts_get_sites(megatron_world, tiny_shape, grouped):
    """MoE with the TE spec: grouped experts (`TEGroupedMLP` with TE grouped linears) get one
    grouped site per linear, `SequentialMLP` experts of TE linears one site per expert."""
    from support.megatron_cpu import cpu_shim

    with cpu_shim():
        torch.manual_seed(0)
        model = build_gpt(
            tiny_shape,
            num_experts=4,
            moe_grouped_gemm=grouped,
            layer_spec=te_standin_layer_spec(num_experts=4, moe_grouped_gemm=grouped),
        )
        attach_lora(model, LoraConfig(rank=4, alpha=8.0))
        kinds = {}
        for e in iter_lora_sites(model):
            if ".experts." in e.path and ".layers.0." in e.path:
                kinds[e.path.split(".experts.")[1]] = (e.kind, e.site.info.expert_index)
        _seed_b_(model)
        loss = _logits(model, _tokens(0)).float().pow(2).mean()
        loss.backward()
    if grouped:
        assert kinds == {"linear_fc1": ("grouped_column", 0), "linear_fc2": ("grouped_row", 0)}
    else:
        assert len(kinds) == 8 and kinds["local_experts.3.linear_fc2"] == ("row", 3)
    grads = [e.adapter.a.grad for e in iter_lora_sites(model) if ".experts." in e.path]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
