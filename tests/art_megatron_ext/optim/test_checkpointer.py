"""The one `Checkpointer` interface: layout chosen once, one manifest, one background lane."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from art_megatron_ext.optim import (
    CheckpointConfig,
    CheckpointFormatError,
    CheckpointIO,
    CheckpointLayout,
    DistCheckpointer,
    FileRecord,
    Manifest,
    ShardedCheckpointer,
    checkpointer_factory,
)


def per_rank(directory, io=None) -> ShardedCheckpointer:
    return ShardedCheckpointer(CheckpointConfig(directory), io=io)


def test_the_factory_maps_each_layout_to_its_checkpointer_and_refuses_what_it_cannot_honour(
    tmp_path,
):
    opened = checkpointer_factory(CheckpointLayout.PER_RANK, weights_only=False)(tmp_path)
    assert isinstance(opened, ShardedCheckpointer) and not opened.config.weights_only
    assert isinstance(checkpointer_factory(CheckpointLayout.DIST)(tmp_path), DistCheckpointer)
    with pytest.raises(ValueError, match="default process group"):
        checkpointer_factory(CheckpointLayout.DIST, group=object())
    with pytest.raises(TypeError, match="CheckpointLayout"):
        checkpointer_factory("per-rank")


def test_a_checkpoint_of_the_other_layout_is_refused_naming_it_and_left_alone(tmp_path):
    dist_dir, rank_dir = tmp_path / "dist", tmp_path / "rank"
    dist_dir.mkdir()
    files = (FileRecord("__0_0.distcp", 3, "0" * 32),)
    dist_manifest = Manifest(2, 4, 1, "rl", files, layout=CheckpointLayout.DIST).to_json()
    (dist_dir / "CURRENT.json").write_bytes(dist_manifest)
    with pytest.raises(CheckpointFormatError, match=r"CheckpointLayout\.DIST") as info:
        per_rank(dist_dir).load()
    assert "dist_checkpointing checkpoint" in str(info.value)
    with pytest.raises(CheckpointFormatError, match=r"CheckpointLayout\.DIST"):
        per_rank(dist_dir).save({"x": torch.ones(2)}, step=5, objective="rl")
    assert (dist_dir / "CURRENT.json").read_bytes() == dist_manifest  # nothing was committed

    per_rank(rank_dir).save({"x": torch.ones(2)}, step=1, objective="rl")
    with pytest.raises(CheckpointFormatError, match=r"CheckpointLayout\.PER_RANK"):
        DistCheckpointer(rank_dir).latest()


class RecordingIO(CheckpointIO):
    """Records shard writes and commits of checkpointer `tag` into a shared list; its shard
    writes wait for `gate` when one is given."""

    def __init__(self, tag: str, events: list[str], gate: threading.Event | None = None):
        self.tag, self.events, self.gate = tag, events, gate
        self.writing = threading.Event()

    def write(self, f, data):
        if ".rank-" in f.name:
            self.writing.set()
            if self.gate is not None:
                assert self.gate.wait(60), "the test never opened the gate"
            if not self.events or self.events[-1] != f"write {self.tag}":
                self.events.append(f"write {self.tag}")
        super().write(f, data)

    def replace(self, src, dst):
        if dst.name == "CURRENT.json":
            self.events.append(f"commit {self.tag}")
        super().replace(src, dst)


def test_two_checkpointers_share_one_lane_and_their_background_saves_run_in_call_order(
    tmp_path,
):
    events: list[str] = []
    gate = threading.Event()
    first = per_rank(tmp_path / "a", RecordingIO("a", events, gate))
    second = per_rank(tmp_path / "b", RecordingIO("b", events))
    saving_a = first.save_async({"x": torch.full((1024,), 1.0)}, step=1, objective="rl")
    assert first.io.writing.wait(30)  # the lane's thread is inside a's shard write
    saving_b = second.save_async({"x": torch.full((1024,), 2.0)}, step=1, objective="rl")
    assert first._background_group is second._background_group  # one gloo group, one thread
    assert not saving_a.done() and not saving_b.done()
    gate.set()
    assert second.close().step == 1 and first.close().step == 1
    assert events == ["write a", "commit a", "write b", "commit b"]
    loaded = per_rank(tmp_path / "b").load()
    assert torch.equal(loaded.state["x"], torch.full((1024,), 2.0))


def test_the_manifest_a_save_returns_is_the_one_on_disk(tmp_path):
    manifest = per_rank(tmp_path).save({"x": torch.arange(4)}, step=3, objective="sft")
    assert Manifest.from_json((tmp_path / "CURRENT.json").read_bytes(), tmp_path) == manifest
    assert manifest.layout is CheckpointLayout.PER_RANK
    assert json.loads(manifest.to_json())["files"][0]["rank"] == 0
