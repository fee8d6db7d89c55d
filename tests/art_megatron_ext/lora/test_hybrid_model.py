"""LoRA on megatron-core 0.19's `HybridModel`, the class `GPTModel`'s deprecation notice points to.

A `HybridModel` gives attention and MLP a layer each: the two-layer GPT is pattern `*-*-`
(four layers; Megatron's `docs/user-guide/hybrid-model-migration.md`). Its parameters differ
from the GPT's only in layer indices and the final norm's name:

| GPTModel                                  | HybridModel `*-*-`                          |
| ----------------------------------------- | ------------------------------------------- |
| `decoder.layers.{i}.input_layernorm.*`,   | `decoder.layers.{2i}.…` (attention layer)   |
| `decoder.layers.{i}.self_attention.*`     |                                             |
| `decoder.layers.{i}.pre_mlp_layernorm.*`, | `decoder.layers.{2i+1}.…` (MLP layer)       |
| `decoder.layers.{i}.mlp.*`                |                                             |
| `decoder.final_layernorm.weight`          | `decoder.final_norm.weight`                 |

Megatron ships its hybrid spec for Transformer Engine only (`hybrid_layer_specs.py`; its final
norm is always `TENorm`), so here the stack is built from the pieces of the local GPT spec,
and, for the TE layout (layernorm fused into QKV and FC1), from the TE stand-in
(`support/te_standin.py`), with a torch RMSNorm as final norm (`_LocalNormHybridStack`).
The full-weight stream (`art_megatron_ext.weights`) does not know these names yet: the last
test records what it does today.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
import torch
from safetensors.torch import load_file

from art_megatron_ext.lora import (
    LoraConfig,
    activate_slot,
    attach_lora,
    iter_lora_sites,
    zero_lora_padding_,
)
from art_megatron_ext.lora.export import export_peft
from art_megatron_ext.lora.layer_position import UnsupportedLayerPattern, gpt_layer_pairs
from art_megatron_ext.lora.tiny_gpt import build_gpt

PATTERN = "*-*-"  # the tiny shape's two GPT layers


def _local_norm_stack():
    from megatron.core.models.hybrid.hybrid_block import HybridStack
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    class _LocalNormHybridStack(HybridStack):
        """`HybridStack` with a torch norm as final norm: 0.19.2 builds `TENorm` there
        unconditionally, which raises without Transformer Engine."""

        def __init__(self, config, submodules, post_layer_norm: bool = True, **kwargs):
            super().__init__(config, submodules, post_layer_norm=False, **kwargs)
            self.post_layer_norm = post_layer_norm
            if self.post_process and post_layer_norm:
                self.final_norm = WrappedTorchNorm(
                    config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon
                )

    return _LocalNormHybridStack


def _hybrid_stack_spec(spec: str):
    """Attention (`*`) and MLP (`-`) layers as Megatron's `hybrid_stack_spec` lays them out,
    from local linears (`spec="local"`, with separate norms) or the TE stand-ins (`"te"`)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer

    gpt_layer = get_gpt_layer_local_spec(normalization="RMSNorm").submodules
    if spec == "te":
        from support.te_standin import TELayerNormColumnParallelLinear, TERowParallelLinear

        attention_spec = dataclasses.replace(
            gpt_layer.self_attention,
            submodules=dataclasses.replace(
                gpt_layer.self_attention.submodules,
                linear_qkv=TELayerNormColumnParallelLinear,
                linear_proj=TERowParallelLinear,
            ),
        )
        mlp = functools.partial(
            MLP.as_mlp_submodule,
            submodules=MLPSubmodules(
                linear_fc1=TELayerNormColumnParallelLinear, linear_fc2=TERowParallelLinear
            ),
        )
        gpt_layer = dataclasses.replace(
            gpt_layer,
            input_layernorm=IdentityOp,
            self_attention=attention_spec,
            pre_mlp_layernorm=IdentityOp,
            mlp=mlp,
        )
    attention = dataclasses.replace(
        gpt_layer, pre_mlp_layernorm=IdentityOp, mlp=IdentityOp, mlp_bda=IdentityFuncOp
    )
    mlp_only = dataclasses.replace(
        gpt_layer,
        input_layernorm=IdentityOp,
        self_attention=IdentityOp,
        self_attn_bda=IdentityFuncOp,
    )
    return ModuleSpec(
        module=_local_norm_stack(),
        submodules=HybridStackSubmodules(
            attention_layer=ModuleSpec(module=TransformerLayer, submodules=attention),
            mlp_layer=ModuleSpec(module=MLPLayer, submodules=mlp_only),
        ),
    )


def _build_hybrid(shape, gpt_config, pattern: str = PATTERN, spec: str = "local"):
    """A `HybridModel` with the GPT's config (num_layers from the pattern, as Megatron's
    `pretrain_hybrid.py` derives it), RoPE and untied output as `tiny_gpt.build_gpt`."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    num_layers = len(pattern.split("/")[0].replace("|", ""))
    return HybridModel(
        config=dataclasses.replace(gpt_config, num_layers=num_layers),
        hybrid_stack_spec=_hybrid_stack_spec(spec),
        vocab_size=shape.vocab_size,
        max_sequence_length=256,
        hybrid_layer_pattern=pattern,
        position_embedding_type="rope",
        rotary_base=int(shape.rope_theta),
        share_embeddings_and_output_weights=False,
    )


def _hybrid_name(gpt_name: str) -> str:
    """The `*-`-pattern HybridModel name of a GPTModel parameter (the table above)."""
    if gpt_name.startswith("decoder.final_layernorm."):
        return gpt_name.replace("final_layernorm", "final_norm")
    if not gpt_name.startswith("decoder.layers."):
        return gpt_name
    index, rest = gpt_name.removeprefix("decoder.layers.").split(".", 1)
    mlp = rest.startswith(("mlp.", "pre_mlp_layernorm."))
    return f"decoder.layers.{2 * int(index) + int(mlp)}.{rest}"


def _twins(shape, spec: str, **lora):
    """The tiny GPT and its `*-*-` HybridModel with the GPT's weights, LoRA attached to both."""
    from support.te_standin import te_standin_layer_spec

    torch.manual_seed(0)
    gpt = build_gpt(shape, layer_spec=te_standin_layer_spec() if spec == "te" else None)
    hybrid = _build_hybrid(shape, gpt.config, spec=spec)
    hybrid_params = dict(hybrid.named_parameters())
    gpt_params = dict(gpt.named_parameters())
    assert {_hybrid_name(n) for n in gpt_params} == set(hybrid_params)
    with torch.no_grad():
        for name, value in gpt_params.items():
            hybrid_params[_hybrid_name(name)].copy_(value)
    config = LoraConfig(**{"rank": 8, "alpha": 16.0, **lora})
    return gpt, hybrid, attach_lora(gpt, config), attach_lora(hybrid, config)


def _loss(model, seed: int):
    from art_megatron_ext.lora.cpu_runtime import causal_mask

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (2, 13), generator=g)
    positions = torch.arange(12).expand(2, 12)
    return model(tokens[:, :-1], positions, causal_mask(12), labels=tokens[:, 1:]).mean()


def _train_and_export(model, out) -> list[float]:
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(2):
        loss = _loss(model, step)
        loss.backward()
        zero_lora_padding_(model, optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        zero_lora_padding_(model, optimizer)
        losses.append(loss.item())
    export_peft(model, "default", out, "tiny")
    return losses


@pytest.mark.parametrize("spec", ["local", "te"])
def test_hybrid_sites_are_the_gpt_sites(megatron_world, tiny_shape, spec):
    """Each GPT layer's four sites sit in two hybrid layers (attention, MLP) and carry the
    GPT layer's number, so they get the same stable keys, A init and Hugging Face names."""
    _, _, gpt_sites, hybrid_sites = _twins(tiny_shape, spec)
    paths = [s.info.path for s in hybrid_sites]
    assert paths == [_hybrid_name(s.info.path) for s in gpt_sites]
    assert sorted(paths) == [
        "decoder.layers.0.self_attention.linear_proj",
        "decoder.layers.0.self_attention.linear_qkv",
        "decoder.layers.1.mlp.linear_fc1",
        "decoder.layers.1.mlp.linear_fc2",
        "decoder.layers.2.self_attention.linear_proj",
        "decoder.layers.2.self_attention.linear_qkv",
        "decoder.layers.3.mlp.linear_fc1",
        "decoder.layers.3.mlp.linear_fc2",
    ]
    assert [s.info.layer_number for s in hybrid_sites] == [1, 1, 1, 1, 2, 2, 2, 2]
    assert [dataclasses.replace(s.info, path="") for s in hybrid_sites] == [
        dataclasses.replace(s.info, path="") for s in gpt_sites
    ]
    fused = {s.info.target for s in hybrid_sites if s.info.layernorm_input}
    assert fused == ({"linear_qkv", "linear_fc1"} if spec == "te" else set())
    for g, h in zip(gpt_sites, hybrid_sites, strict=True):
        assert torch.equal(g.slots["default"].a, h.slots["default"].a)


@pytest.mark.parametrize("spec", ["local", "te"])
def test_hybrid_trains_and_exports_the_gpt_adapter(megatron_world, tiny_shape, spec, tmp_path):
    """Same weights, same LoRA: forward with and without LoRA, two Adam steps and the PEFT
    directory equal the GPTModel's bit for bit (same Hugging Face module names)."""
    gpt, hybrid, _, _ = _twins(tiny_shape, spec)
    with torch.no_grad(), activate_slot(gpt, None), activate_slot(hybrid, None):
        torch.testing.assert_close(_loss(hybrid, 9), _loss(gpt, 9), rtol=0, atol=0)
    want = _train_and_export(gpt, tmp_path / "gpt")
    got = _train_and_export(hybrid, tmp_path / "hybrid")
    assert got == want and want[1] != want[0]
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (tmp_path / "hybrid" / name).read_bytes() == (tmp_path / "gpt" / name).read_bytes()
    tensors = load_file(tmp_path / "hybrid" / "adapter_model.safetensors")
    assert len(tensors) == 2 * 7 * 2 and "base_model.model.model.layers.1.mlp.down_proj" in {
        k.split(".lora_")[0] for k in tensors
    }
    with torch.no_grad():
        torch.testing.assert_close(_loss(hybrid, 9), _loss(gpt, 9), rtol=0, atol=0)


def test_hybrid_recompute_keeps_the_lora_gradients(megatron_world, tiny_shape):
    """`HybridStack`'s full recompute (`megatron.core.recompute.checkpointed_forward`, one
    checkpoint per layer) with a frozen base: the LoRA gradients equal those without
    recompute. They reach the recomputed layers only because `attach_lora` marks the
    embedding output as requiring grad (`HybridModel.embedding`, as in GPTModel)."""
    _, hybrid, _, sites = _twins(tiny_shape, "local")
    with torch.no_grad():
        for site in sites:  # non-zero B, so every factor gets a gradient
            site.slots["default"].b.normal_(0, 0.05)

    def grads(recompute: bool):
        hybrid.decoder.config.recompute_granularity = "full" if recompute else None
        hybrid.zero_grad(set_to_none=True)
        _loss(hybrid, 0).backward()
        return [p.grad.clone() for e in iter_lora_sites(hybrid) for _, p in e.tensors]

    hybrid.config.recompute_method, hybrid.config.recompute_num_layers = "uniform", 1
    want, got = grads(False), grads(True)
    assert len(want) == 16 and all(g.abs().sum() > 0 for g in want)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


def test_gpt_layer_pairs_follow_megatrons_pairing():
    """The i-th `*` and the i-th `-`/`E` form GPT layer i; `|` (pipeline segments) and the
    multi-token-prediction part after `/` do not count."""
    assert gpt_layer_pairs("*-*-") == [(0, 1), (2, 3)]
    assert gpt_layer_pairs("*E*-|*-/*-") == [(0, 1), (2, 3), (4, 5)]
    assert gpt_layer_pairs("**--") == [(0, 2), (1, 3)]
    for pattern in ("*--", "M*-", "*-G", ""):
        with pytest.raises(UnsupportedLayerPattern, match="does not pair into GPT layers"):
            gpt_layer_pairs(pattern)


@pytest.mark.parametrize(
    ("pattern", "why"),
    [("*--", "1 '*', 2 '-'/'E'"), ("M*-", "and ['M']")],
    ids=["unpaired", "mamba"],
)
def test_a_pattern_without_gpt_layers_is_refused_at_attach(
    megatron_world, tiny_shape, pattern, why
):
    """Sites are numbered by GPT layer; a pattern that does not pair into GPT layers is refused
    by name (its `M` layers here are Megatron's default `IdentityOp`), before any change."""
    torch.manual_seed(0)
    hybrid = _build_hybrid(tiny_shape, build_gpt(tiny_shape).config, pattern=pattern)
    with pytest.raises(
        UnsupportedLayerPattern, match=f"pattern {re.escape(repr(pattern))}.*{re.escape(why)}"
    ):
        attach_lora(hybrid, LoraConfig(rank=8))
    assert not any(hasattr(m, "lora") for m in hybrid.modules())
    assert all(p.requires_grad for p in hybrid.parameters())


def test_full_weight_stream_refuses_a_hybrid_model_before_sending(megatron_world, tiny_shape):
    """`stream_hf_weights` reads GPTModel names; on a HybridModel it refuses up front (before,
    it streamed the embedding and layer 0's attention, then raised `KeyError` at the MLP norm
    that lives in hybrid layer 1: a receiver got half a model)."""
    from art_megatron_ext.weights import stream_hf_weights

    torch.manual_seed(0)
    hybrid = _build_hybrid(tiny_shape, build_gpt(tiny_shape).config)
    sent = []
    with pytest.raises(NotImplementedError, match=r"HybridModel .*nothing was streamed"):
        stream_hf_weights(hybrid, tiny_shape, lambda name, tensor: sent.append(name))
    assert sent == []
