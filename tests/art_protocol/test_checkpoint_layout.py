"""A full-weight update's tensors against the served model's, from safetensors headers only."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from art_protocol.checkpoint_layout import (
    LayoutError,
    TensorSpec,
    layout_problems,
    read_layout,
)


def _checkpoint(path, tensors, shards: int = 1):
    path.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return path
    weight_map = {}
    for i in range(shards):
        part = {n: tensors[n] for n in names[i::shards]}
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(path / file))
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


SERVED = {
    "model.embed_tokens.weight": torch.zeros(10, 4, dtype=torch.bfloat16),
    "model.layers.0.self_attn.q_proj.weight": torch.zeros(4, 4, dtype=torch.bfloat16),
    "model.norm.weight": torch.ones(4, dtype=torch.float32),
}


@pytest.mark.parametrize("shards", [1, 2])
def test_layout_is_read_from_the_headers_of_one_file_or_an_index(tmp_path, shards):
    layout = read_layout(_checkpoint(tmp_path / "ckpt", SERVED, shards))
    assert layout == {
        "model.embed_tokens.weight": TensorSpec("BF16", (10, 4)),
        "model.layers.0.self_attn.q_proj.weight": TensorSpec("BF16", (4, 4)),
        "model.norm.weight": TensorSpec("F32", (4,)),
    }


def test_every_problem_of_an_update_is_named(tmp_path):
    served = read_layout(_checkpoint(tmp_path / "served", SERVED))
    assert layout_problems(served, served) == []
    bad = dict(SERVED)
    bad["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(4, 5, dtype=torch.bfloat16)
    bad["model.norm.weight"] = torch.ones(4, dtype=torch.bfloat16)
    bad["model.layers.0.self_attn.qq_proj.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    del bad["model.embed_tokens.weight"]
    update = read_layout(_checkpoint(tmp_path / "update", bad))
    assert layout_problems(served, update) == [
        "model.layers.0.self_attn.qq_proj.weight: the served model has no such tensor",
        "model.embed_tokens.weight: missing from the update",
        "model.layers.0.self_attn.q_proj.weight: shape [4, 5], the served model's is [4, 4]",
        "model.norm.weight: dtype BF16, the served model's is F32",
    ]
    # a partial update may leave tensors out, but not add or reshape any
    partial = layout_problems(served, update, partial=True)
    assert "model.embed_tokens.weight: missing from the update" not in partial
    assert len(partial) == 3


def test_the_tiny_served_model_fits_itself_and_unreadable_checkpoints_are_named(tmp_path):
    from support.vllm_server import tiny_paths

    model_dir, _ = tiny_paths()
    served = read_layout(model_dir)
    assert "lm_head.weight" in served and layout_problems(served, dict(served)) == []
    (tmp_path / "empty").mkdir()
    with pytest.raises(LayoutError, match=r"neither model\.safetensors nor"):
        read_layout(tmp_path / "empty")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(LayoutError, match="header is not JSON"):
        read_layout(tmp_path / "junk")
