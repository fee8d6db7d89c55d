"""Expert LoRA on a `TEGroupedMLP` that runs Transformer Engine's op fuser is refused at attach.

With `TransformerConfig.use_transformer_engine_op_fuser`, Megatron 0.19's `TEGroupedMLP`
computes its experts from fused TE ops and never calls `linear_fc1` / `linear_fc2`, so a LoRA
site on them would never change an output nor get a gradient. The model is the TE-spec MoE
GPT built on the TE stand-in (CPU); with the flag on, Megatron's own constructor takes the
fused path once told TE can fuse the layer (the stand-in is not TE, so that check is stubbed).
"""

from __future__ import annotations

import functools

import pytest
import torch
from support.te_standin import te_standin_layer_spec

from art_megatron_ext.lora import LoraConfig, UnsupportedLinear, attach_lora, iter_lora_sites
from art_megatron_ext.lora.attach import BypassedLinear
from art_megatron_ext.lora.tiny_gpt import build_gpt

FLAG = "use_transformer_engine_op_fuser"


def _moe_gpt(tiny_shape, monkeypatch, op_fuser: bool):
    """A TE-spec MoE GPT with grouped experts (`TEGroupedMLP`), `FLAG` set as asked."""
    from megatron.core.transformer import transformer_config
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from support.megatron_cpu import cpu_shim

    if op_fuser:
        config_class = transformer_config.TransformerConfig
        monkeypatch.setattr(
            transformer_config, "TransformerConfig", functools.partial(config_class, **{FLAG: True})
        )
        monkeypatch.setattr(TEGroupedMLP, "_is_fused_impl_supported", lambda self: True)
    with cpu_shim():
        torch.manual_seed(0)
        model = build_gpt(
            tiny_shape,
            num_experts=4,
            moe_grouped_gemm=True,
            layer_spec=te_standin_layer_spec(num_experts=4, moe_grouped_gemm=True),
        )
    assert getattr(model.config, FLAG) is op_fuser
    return model


def test_expert_lora_under_the_op_fuser_is_refused_naming_the_flag(
    megatron_world, tiny_shape, monkeypatch
):
    model = _moe_gpt(tiny_shape, monkeypatch, op_fuser=True)
    with pytest.raises(BypassedLinear) as err:
        attach_lora(model, LoraConfig(rank=4, alpha=8.0))
    message = str(err.value)
    assert "decoder.layers.0.mlp.experts.linear_fc1" in message
    assert f"{FLAG}=True" in message and f"{FLAG}=False" in message  # the cause and the way out
    assert "LoraConfig.targets" in message
    assert isinstance(err.value, UnsupportedLinear)  # callers catching the base still see it
    # refused before anything changed
    assert not any(hasattr(m, "lora") for m in model.modules())
    assert all(p.requires_grad for p in model.parameters())


def test_op_fuser_model_takes_lora_on_targets_it_still_calls(
    megatron_world, tiny_shape, monkeypatch
):
    model = _moe_gpt(tiny_shape, monkeypatch, op_fuser=True)
    sites = attach_lora(model, LoraConfig(rank=4, alpha=8.0, targets=("linear_qkv", "linear_proj")))
    assert sites and all(".experts." not in s.info.path for s in sites)


def test_without_the_op_fuser_expert_lora_attaches_as_before(
    megatron_world, tiny_shape, monkeypatch
):
    model = _moe_gpt(tiny_shape, monkeypatch, op_fuser=False)
    attach_lora(model, LoraConfig(rank=4, alpha=8.0))
    kinds = {
        e.path.split(".experts.")[1]: e.kind
        for e in iter_lora_sites(model)
        if ".experts." in e.path
    }
    assert kinds == {"linear_fc1": "grouped_column", "linear_fc2": "grouped_row"}
