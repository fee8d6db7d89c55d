"""HF Qwen3-MoE -> Megatron GPT: shape, layer pattern, weight mapping and the router rule.

Self-contained: a small random Qwen3-MoE checkpoint (config.json + safetensors in HF's
per-expert layout) is written here, so the test needs no transformers. The end-to-end check
against vLLM and HF is tests/cross_env/test_moe_parity.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from support.hf_tiny_moe import MOE_CFG, random_qwen3_moe_checkpoint

pytestmark = pytest.mark.train

CFG = MOE_CFG


@pytest.fixture()
def moe_world(megatron_world):
    """The one-rank Megatron world plus the CPU shim MoE layers need (dispatcher streams)."""
    from support.megatron_cpu import cpu_shim

    with cpu_shim():
        yield


def write_checkpoint(path, **overrides):
    """A random bf16 Qwen3-MoE checkpoint in `path`; returns its tensors."""
    return random_qwen3_moe_checkpoint(path, dtype=torch.bfloat16, **overrides)


def test_shape_reads_the_dense_and_moe_layer_pattern(tmp_path):
    from art_megatron_ext.lora.hf_moe_weights import MoeShape

    write_checkpoint(tmp_path / "a")
    shape = MoeShape.from_hf_config(tmp_path / "a")
    assert (shape.dense_layers, shape.moe_layers) == ((0,), (1, 2))
    assert (shape.num_experts, shape.top_k, shape.moe_intermediate_size) == (4, 2, 16)
    write_checkpoint(tmp_path / "b", mlp_only_layers=[], decoder_sparse_step=2)
    assert MoeShape.from_hf_config(tmp_path / "b").dense_layers == (0, 2)


def test_shape_refuses_a_non_moe_config_naming_it(tmp_path):
    from art_megatron_ext.lora.hf_moe_weights import MoeShape

    (tmp_path / "config.json").write_text(json.dumps({**CFG, "model_type": "llama"}))
    with pytest.raises(
        ValueError, match=r"config.json.*'llama' is not mapped by the Qwen3-MoE mapping"
    ):
        MoeShape.from_hf_config(tmp_path / "config.json")


def test_every_megatron_parameter_comes_from_the_checkpoint(tmp_path, moe_world):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from art_megatron_ext.lora.hf_moe_weights import MoeShape, build_moe_gpt, load_hf_moe_weights

    hf = write_checkpoint(tmp_path)
    shape = MoeShape.from_hf_config(tmp_path)
    torch.manual_seed(0)
    model = build_moe_gpt(shape)
    assert [isinstance(layer.mlp, MoELayer) for layer in model.decoder.layers] == [0, 1, 1]
    load_hf_moe_weights(model, tmp_path, shape)
    params = dict(model.named_parameters())
    layer = "decoder.layers.2."
    assert torch.equal(
        params[layer + "mlp.router.weight"], hf["model.layers.2.mlp.gate.weight"].float()
    )
    fc1 = params[layer + "mlp.experts.local_experts.3.linear_fc1.weight"]
    gate, up = (hf[f"model.layers.2.mlp.experts.3.{n}_proj.weight"].float() for n in ("gate", "up"))
    assert torch.equal(fc1, torch.cat([gate, up]))
    assert torch.equal(
        params[layer + "self_attention.k_layernorm.weight"],
        hf["model.layers.2.self_attn.k_norm.weight"].float(),
    )
    assert torch.equal(
        params["decoder.layers.0.mlp.linear_fc1.weight"][:48],
        hf["model.layers.0.mlp.gate_proj.weight"].float(),
    )


def test_missing_hf_tensor_is_an_error_naming_the_checkpoint(tmp_path, moe_world):
    from safetensors.torch import load_file, save_file

    from art_megatron_ext.lora.hf_moe_weights import MoeShape, build_moe_gpt, load_hf_moe_weights

    write_checkpoint(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    shape = MoeShape.from_hf_config(tmp_path)
    model = build_moe_gpt(shape)
    with pytest.raises(KeyError, match=r"experts\.2\.up_proj"):
        load_hf_moe_weights(model, tmp_path, shape)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_megatron_router_follows_the_hf_routing_rule(tmp_path, moe_world, norm_topk_prob):
    """HF: softmax over all experts, top-k, renormalize over the k iff `norm_topk_prob`."""
    from art_megatron_ext.lora.hf_moe_weights import MoeShape, build_moe_gpt, load_hf_moe_weights

    write_checkpoint(tmp_path, norm_topk_prob=norm_topk_prob)
    shape = MoeShape.from_hf_config(tmp_path)
    model = build_moe_gpt(shape)
    load_hf_moe_weights(model, tmp_path, shape)
    router = model.decoder.layers[1].mlp.router
    x = torch.randn(64, shape.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        probs, routing_map = router(x)
        scores = torch.softmax(x @ router.weight.T, dim=-1)
    top = torch.topk(scores, shape.top_k, dim=-1)
    values = top.values / top.values.sum(-1, keepdim=True) if norm_topk_prob else top.values
    want = torch.zeros_like(scores).scatter(1, top.indices, values)
    assert torch.equal(routing_map, want > 0)
    torch.testing.assert_close(probs, want, rtol=1e-6, atol=1e-6)
