"""`make tiny` is deterministic and writes what the demo and tests rely on."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from safetensors.numpy import load_file


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    outs = []
    for i, hashseed in enumerate(("1", "2")):  # different hash seeds: set ordering must not leak
        out = root / f"run{i}"
        subprocess.run(
            [sys.executable, "-m", "art_vllm_plugin.tiny_model", "--out", str(out)],
            check=True,
            timeout=600,
            env={**_env(), "PYTHONHASHSEED": hashseed},
        )
        outs.append(out)
    return outs


def _env():
    import os

    return dict(os.environ)


def _files(root):
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())


def test_two_runs_are_byte_identical(two_runs):
    a, b = two_runs
    assert _files(a) == _files(b)
    assert len(_files(a)) >= 9
    for rel in _files(a):
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


def test_model_has_the_documented_shape(two_runs):
    cfg = json.loads((two_runs[0] / "model" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"]) == (128, 2)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (4, 2)
    assert cfg["dtype"] == "bfloat16"
    tok_cfg = json.loads((two_runs[0] / "model" / "tokenizer_config.json").read_text())
    template = two_runs[0] / "model" / "chat_template.jinja"
    assert template.exists() or "chat_template" in tok_cfg


def test_three_distinct_adapters_with_nonzero_b(two_runs):
    tensors = {}
    for name in ("a", "b", "c"):
        d = two_runs[0] / "adapters" / name
        cfg = json.loads((d / "adapter_config.json").read_text())
        assert cfg["r"] == 8
        assert cfg["target_modules"] == sorted(
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        )
        tensors[name] = load_file(d / "adapter_model.safetensors")
        b_keys = [k for k in tensors[name] if "lora_B" in k]
        assert len(b_keys) == 2 * 7
        assert all(abs(tensors[name][k]).max() > 0 for k in b_keys)
    key = next(k for k in tensors["a"] if "lora_B" in k)
    assert not (tensors["a"][key] == tensors["b"][key]).all()
    assert not (tensors["b"][key] == tensors["c"][key]).all()


def test_moe_model_has_the_documented_shape(two_runs):
    moe = two_runs[0] / "moe"
    cfg = json.loads((moe / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"]) == (128, 3, 32)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (4, 2)
    assert cfg["num_local_experts"] == 8 and cfg["num_experts_per_tok"] == 2
    assert cfg["norm_topk_prob"] is True and cfg["mlp_only_layers"] == [0]
    assert (cfg["moe_intermediate_size"], cfg["intermediate_size"]) == (64, 256)
    assert cfg["dtype"] == "bfloat16"
    from safetensors.torch import load_file as load_torch  # numpy has no bfloat16

    weights = load_torch(moe / "model.safetensors")
    assert "model.layers.0.mlp.gate_proj.weight" in weights  # the dense layer
    assert not any(k.startswith("model.layers.0.mlp.experts.") for k in weights)
    for layer in (1, 2):
        assert weights[f"model.layers.{layer}.mlp.gate.weight"].shape == (8, 128)
        experts = {k.split(".")[5] for k in weights if f"layers.{layer}.mlp.experts." in k}
        assert experts == {str(e) for e in range(8)}
    # norms are seeded away from 1, so a dropped or swapped norm changes the logits
    assert all((v != 1).any() for k, v in weights.items() if k.endswith("norm.weight"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (moe / name).read_bytes() == (two_runs[0] / "model" / name).read_bytes()
