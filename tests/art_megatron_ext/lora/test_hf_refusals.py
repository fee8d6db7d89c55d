"""Nothing of a Hugging Face checkpoint is dropped silently on the way into Megatron.

A config field that changes the maths and is not mapped (a rope type, an MLP bias, sliding
windows, an unknown field) is refused by name before a model is built, every such field at
once; a checkpoint tensor the mapping does not read (an `o_proj` bias) or lacks (a
`lm_head.weight` of an untied config) is refused by name before a weight is written. Before,
`GptShape.from_hf_config` read what it knew and ignored the rest, and the loader never looked
at the tensors it did not use.
"""

from __future__ import annotations

import json

import pytest
import torch
from support.gpt_shapes import TINY
from support.hf_tiny import random_llama_checkpoint

from art_megatron_ext.lora.hf_config import UnmappedConfig, padded_vocab_size, rope_inv_freq
from art_megatron_ext.lora.tiny_gpt import GptShape

LLAMA = dict(
    TINY,
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    hidden_act="silu",
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False,
    attention_bias=False,
    mlp_bias=False,
    torch_dtype="bfloat16",
)


def _config(tmp_path, **changes) -> str:
    cfg = {**LLAMA, **changes}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_the_plain_config_is_mapped(tmp_path):
    shape = GptShape.from_hf_config(_config(tmp_path))
    assert shape == GptShape(**TINY)
    mistral = _config(tmp_path, model_type="mistral", sliding_window=None)
    assert GptShape.from_hf_config(mistral) == shape  # no window: full attention


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope type 'yarn'"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(attention_bias=True), "attention_bias (Llama's adds an o_proj bias too)"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(use_sliding_window=True, sliding_window=64), "sliding-window attention"),
        (dict(model_type="mistral", sliding_window=4096), "Mistral's sliding_window"),
        (dict(quantization_config={"quant_method": "fp8"}), "field 'quantization_config'"),
        (dict(partial_rotary_factor=0.5), "field 'partial_rotary_factor'"),
        (dict(model_type="gemma2"), "model_type 'gemma2'"),
    ],
)
def test_an_unmapped_config_field_is_refused_by_name(tmp_path, changes, named):
    with pytest.raises(UnmappedConfig) as refused:
        GptShape.from_hf_config(_config(tmp_path, **changes))
    assert named in str(refused.value)


def test_every_unmapped_field_is_named_at_once(tmp_path):
    with pytest.raises(UnmappedConfig) as refused:
        GptShape.from_hf_config(_config(tmp_path, mlp_bias=True, pretraining_tp=2, foo=1))
    text = str(refused.value)
    assert "mlp_bias" in text and "pretraining_tp" in text and "field 'foo'" in text


def test_llama3_rope_is_the_checkpoints_own(tmp_path):
    """The inverse frequencies come from the config's llama3 values, not Megatron's fixed
    ones (low 1, high 4, original 8192): with original 64 they differ."""
    rope = dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
        rope_theta=500000.0,
    )
    shape = GptShape.from_hf_config(_config(tmp_path, rope_parameters=rope))
    ours = shape.inv_freq()
    megatrons = rope_inv_freq(32, 500000.0, shape.rope_scaling.__class__("llama3", 8.0))
    assert shape.rope_scaling.original_max_position_embeddings == 64
    assert not torch.equal(ours, megatrons)
    plain = rope_inv_freq(32, 500000.0, None)
    assert torch.equal(ours[:2], plain[:2])  # the highest frequencies are never scaled
    assert torch.equal(ours[-1], plain[-1] / 8.0)  # the lowest are divided by the factor


def test_padded_vocabulary_is_a_multiple_of_divisor_times_tp():
    assert padded_vocab_size(1030, 128, 1) == 1152
    assert padded_vocab_size(1030, 128, 2) == 1280
    assert padded_vocab_size(1030, 1, 2) == 1030
    assert padded_vocab_size(1031, 1, 2) == 1032


def test_a_checkpoint_tensor_the_mapping_does_not_read_is_refused(megatron_world, tmp_path):
    from safetensors.torch import load_file, save_file

    from art_megatron_ext.lora.hf_weights import UnmappedWeights, load_hf_weights
    from art_megatron_ext.lora.tiny_gpt import build_gpt

    shape = GptShape(**TINY)
    ckpt = random_llama_checkpoint(shape, tmp_path / "extra")
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["model.layers.1.self_attn.o_proj.bias"] = torch.ones(128)
    save_file(tensors, str(ckpt / "model.safetensors"))
    torch.manual_seed(0)
    model = build_gpt(shape)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(UnmappedWeights, match=r"model\.layers\.1\.self_attn\.o_proj\.bias"):
        load_hf_weights(model, ckpt, shape)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # untouched


def test_a_missing_lm_head_of_an_untied_config_is_refused(megatron_world, tmp_path):
    from safetensors.torch import load_file, save_file

    from art_megatron_ext.lora.hf_weights import UnmappedWeights, load_hf_weights
    from art_megatron_ext.lora.tiny_gpt import build_gpt

    shape = GptShape(**TINY)
    ckpt = random_llama_checkpoint(shape, tmp_path / "untied")
    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(ckpt / "model.safetensors"))
    torch.manual_seed(0)
    with pytest.raises(UnmappedWeights, match=r"the checkpoint has no tensor 'lm_head\.weight'"):
        load_hf_weights(build_gpt(shape), ckpt, shape)
