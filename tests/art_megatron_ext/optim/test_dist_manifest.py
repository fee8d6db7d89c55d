"""dist_checkpointing manifests: format 2 is written, format 1 is read, and a format-1
checkpoint is refused for a gated grouped-expert LoRA (whose stored row order changed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from art_megatron_ext.optim import CheckpointFormatError, CheckpointLayout, FileRecord, Manifest
from art_megatron_ext.optim.dist_checkpoint import _refuse_format1_gated_grouped


def _manifest(version: int = 2) -> Manifest:
    files = (FileRecord("__0_0.distcp", 10, "0" * 32),)
    return Manifest(3, 7, 2, "rl", files, layout=CheckpointLayout.DIST, format_version=version)


def _factory(dims: int):
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    data = torch.zeros((2, 4, 3)[:dims])
    return ShardedTensorFactory("k", data, lambda *a: [], lambda parts: parts[0])


def test_format_2_is_written_and_format_1_is_read_back():
    body = json.loads(_manifest().to_json())
    assert body["format_version"] == 2
    assert Manifest.from_json(json.dumps(body).encode(), Path("x")).format_version == 2
    body["format_version"] = 1
    assert Manifest.from_json(json.dumps(body).encode(), Path("x")).format_version == 1
    body["format_version"] = 3
    with pytest.raises(CheckpointFormatError, match="format_version 3"):
        Manifest.from_json(json.dumps(body).encode(), Path("x"))


def test_format_1_with_a_gated_grouped_expert_lora_is_refused_naming_the_entry(tmp_path):
    adapter = {"decoder.layers.0.mlp.experts.linear_fc1.lora.slots.default.b": _factory(3)}
    with pytest.raises(CheckpointFormatError, match=r"experts\.linear_fc1\.lora") as info:
        _refuse_format1_gated_grouped(_manifest(1), adapter, tmp_path)
    assert "Nothing was loaded" in str(info.value)
    _refuse_format1_gated_grouped(_manifest(2), adapter, tmp_path)  # format 2: fine
    dense = {"decoder.layers.0.mlp.linear_fc1.lora.slots.default.b": _factory(2)}
    _refuse_format1_gated_grouped(_manifest(1), dense, tmp_path)  # dense gated FC1: fine
