"""Manifest JSON of both layouts: round trip, and refusal of manifests a reader must not trust."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from art_megatron_ext.optim.manifest import (
    CheckpointFormatError,
    CheckpointLayout,
    FileRecord,
    Manifest,
    generation_dir_name,
    is_checkpoint_file,
    shard_name,
)

SOURCE = Path("/ckpt/CURRENT.json")


def manifest(world_size: int, generation: int = 3, step: int = 15, objective: str = "rl"):
    files = tuple(
        FileRecord(
            rank=r, name=shard_name(generation, r, world_size), size=100 + r, digest="ab" * 16
        )
        for r in range(world_size)
    )
    return Manifest(generation, step, world_size, objective, files)


@settings(deadline=None)  # a shared, loaded box: no timed assertions
@given(
    world_size=st.integers(1, 16),
    generation=st.integers(1, 10**8 - 1),
    step=st.integers(0, 10**12),
    objective=st.text(min_size=1, max_size=20),
)
def test_json_round_trip(world_size, generation, step, objective):
    m = manifest(world_size, generation, step, objective)
    assert Manifest.from_json(m.to_json(), SOURCE) == m


def edited(**changes) -> bytes:
    body = json.loads(manifest(2).to_json())
    body.update(changes)
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (edited(format_version=3), "format_version 3 is not supported"),
        (edited(format_version=True), "format_version True is not supported"),
        (edited(format_version=1), "digest 'xxh3-128' is not supported by format_version 1"),
        (edited(format="other"), "format is 'other'"),
        (edited(digest="sha256"), "digest 'sha256' is not supported"),
        (edited(world_size=3), r"lists ranks \[0, 1\] for world size 3"),
        (edited(step="x"), "malformed manifest"),
        (b"{not json", "malformed manifest"),
    ],
)
def test_untrustworthy_manifests_are_refused_naming_the_file(data, message):
    with pytest.raises(CheckpointFormatError, match=message) as info:
        Manifest.from_json(data, SOURCE)
    assert str(SOURCE) in str(info.value)


def test_cleanup_recognises_only_checkpoint_files():
    assert is_checkpoint_file(shard_name(7, 1, 2))
    assert is_checkpoint_file(shard_name(7, 1, 2) + ".tmp")
    assert is_checkpoint_file("CURRENT.json.tmp")
    assert is_checkpoint_file("03-of-04.pt")
    assert is_checkpoint_file(generation_dir_name(7))
    assert not is_checkpoint_file("adapter_model.safetensors")
    assert not is_checkpoint_file("notes.pt")


def test_a_dist_manifest_round_trips_without_ranks_and_names_its_generation_directory():
    files = (FileRecord("__0_0.distcp", 10, "0" * 32), FileRecord(".metadata", 5, "1" * 32))
    m = Manifest(4, 9, 2, "rl", files, layout=CheckpointLayout.DIST)
    body = json.loads(m.to_json())
    assert (
        body["format"] == "art-pipeline/dist-checkpoint" and body["directory"] == m.directory_name
    )
    assert body["layout"] == "megatron.core.dist_checkpointing/torch_dist"
    assert all("rank" not in f for f in body["files"])
    assert Manifest.from_json(m.to_json(), SOURCE) == m
    assert m.kept_names() == {"gen-00000004.dist"}
    assert manifest(2).kept_names() == {r.name for r in manifest(2).files}
