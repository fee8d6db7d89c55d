"""What the DeepSeek-V3 mapping cannot carry into Megatron is refused by name, before a model is
built; the multi-token-prediction layers are the one kind of tensor it leaves out on purpose.

Each refused value is one Megatron-core 0.19.2 computes differently from Hugging Face (see
`lora.hf_deepseek`): the group score (Megatron sums a group's top `top_k // topk_group`, HF its
top 2), `rope_interleave: false`, a yarn cos/sin factor other than 1, un-renormalised sigmoid
top-k. A zoo config that differs in only that field would train a different policy than the
served one without an error; before this mapping every DeepSeek config was refused.
"""

from __future__ import annotations

import json

import pytest
import torch
from support.model_zoo import ZOO

from art_megatron_ext.lora.hf_config import UnmappedConfig
from art_megatron_ext.lora.hf_deepseek import DeepseekShape

pytestmark = pytest.mark.train


def _config(tmp_path, **changes) -> str:
    cfg = {**ZOO["deepseek-v3"][1], "model_type": "deepseek_v3", **changes}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_the_zoo_config_is_mapped(tmp_path):
    shape = DeepseekShape.from_hf_config(_config(tmp_path))
    assert (shape.num_experts, shape.top_k, shape.n_group, shape.topk_group) == (16, 4, 4, 2)
    assert shape.dense_layers == (0,) and shape.moe_layers == (1,)
    assert shape.yarn is not None and shape.yarn.factor == 40.0
    assert shape.yarn.attention_factor == 1.0  # mscale == mscale_all_dim


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        (dict(num_experts_per_tok=2), "num_experts_per_tok // topk_group = 1"),
        (dict(rope_interleave=False), "rope_interleave false"),
        (dict(norm_topk_prob=False), "norm_topk_prob false"),
        (dict(num_key_value_heads=2), "num_key_value_heads != num_attention_heads"),
        (dict(tie_word_embeddings=True), "tie_word_embeddings"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(scoring_func="softmax"), "scoring_func 'softmax'"),
        (dict(quantization_config={"quant_method": "fp8"}), "field 'quantization_config'"),
        (
            dict(
                rope_parameters=dict(
                    rope_type="yarn",
                    rope_theta=10000.0,
                    factor=40.0,
                    original_max_position_embeddings=64,
                    mscale=1.0,
                    mscale_all_dim=0.707,
                )
            ),
            "yarn attention_factor",
        ),
        (dict(rope_parameters=dict(rope_type="llama3", rope_theta=1e4)), "rope type 'llama3'"),
    ],
)
def test_an_unmappable_deepseek_config_is_refused_by_name(tmp_path, changes, named):
    with pytest.raises(UnmappedConfig, match="Nothing was built") as err:
        DeepseekShape.from_hf_config(_config(tmp_path, **changes))
    assert named in str(err.value)


def test_one_group_or_every_group_needs_no_group_score(tmp_path):
    """With one group (Kimi K2's n_group 1) or all groups chosen, no group is ever dropped."""
    for changes in (dict(n_group=1, topk_group=1), dict(n_group=4, topk_group=4)):
        DeepseekShape.from_hf_config(_config(tmp_path, num_experts_per_tok=2, **changes))


def test_yarn_inverse_frequencies_are_hf_own(tmp_path):
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    shape = DeepseekShape.from_hf_config(_config(tmp_path))
    hf = DeepseekV3Config(**ZOO["deepseek-v3"][1])
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    assert factor == 1.0
    torch.testing.assert_close(shape.inv_freq(), want, rtol=0, atol=0)
    # the interpolated band is reached: some frequencies scaled, some not
    dim = shape.qk_rope_head_dim
    plain = 1 / (1e4 ** (torch.arange(0, dim, 2).float() / dim))
    assert (shape.inv_freq() != plain).any() and (shape.inv_freq() == plain).any()


def test_mtp_layers_are_left_out_and_any_other_extra_tensor_is_refused(megatron_world, tmp_path):
    """The published DeepSeek-V3 ships its MTP block as `model.layers.61.*`: loading skips it
    (the causal LM never runs it); an unknown tensor of a real layer is refused, nothing
    written."""
    from safetensors.torch import load_file, save_file
    from support.megatron_cpu import cpu_shim
    from support.model_zoo import checkpoint

    from art_megatron_ext.lora.deepseek_gpt import build_deepseek_gpt
    from art_megatron_ext.lora.hf_deepseek_weights import load_hf_deepseek_weights
    from art_megatron_ext.lora.hf_weights import UnmappedWeights

    ckpt = checkpoint("deepseek-v3", tmp_path)
    shape = DeepseekShape.from_hf_config(ckpt)
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["model.layers.2.eh_proj.weight"] = torch.ones(128, 256, dtype=torch.bfloat16)
    save_file(tensors, str(ckpt / "model.safetensors"))
    torch.manual_seed(0)
    with cpu_shim():  # MoE layers ask for CUDA streams
        model = build_deepseek_gpt(shape)
        load_hf_deepseek_weights(model, ckpt, shape)  # the MTP tensor is not mapped on purpose
        want = tensors["model.layers.1.self_attn.kv_b_proj.weight"].float()
        assert torch.equal(model.decoder.layers[1].self_attention.linear_kv_up_proj.weight, want)

        tensors["model.layers.1.self_attn.o_proj.bias"] = torch.ones(128, dtype=torch.bfloat16)
        save_file(tensors, str(ckpt / "model.safetensors"))
        fresh = build_deepseek_gpt(shape)
        before = {n: p.detach().clone() for n, p in fresh.named_parameters()}
        with pytest.raises(UnmappedWeights, match=r"model\.layers\.1\.self_attn\.o_proj\.bias"):
            load_hf_deepseek_weights(fresh, ckpt, shape)
        assert all(torch.equal(p, before[n]) for n, p in fresh.named_parameters())
