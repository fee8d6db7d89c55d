"""A full-weight update's files, copied to a stage and checked there (`api_server/base_files.py`):
the copy is the trainer's checkpoint with one marker directory per engine, and every misfit
against the served checkpoint (names, shapes, dtypes, non-finite values) is named before any
engine sees the files; a file that leads out of the allowed roots (403) or a truncated shard
(422) is named. No server: the API server calls these on a thread."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from art_protocol.weights_digest import digest_checkpoint
from art_vllm_plugin import staging
from art_vllm_plugin.api_server import base_files
from art_vllm_plugin.api_server.paths import PathPolicy, PathRefused
from art_vllm_plugin.api_server.slot_publish import Engine

SERVED = {
    "a.weight": torch.ones(4, 3, dtype=torch.bfloat16),
    "b.weight": torch.arange(6.0).reshape(2, 3),
}


#: The id of the server the tests stage for (engine 0's `server_id` in a real server).
SERVER = "server-a"


def checkpoint(path: Path, tensors: dict) -> Path:
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def write_stage(config, source: Path, version: int, engines, server: str = SERVER) -> Path:
    """`base_files.write_stage` with the checkpoint's parent as the only allowed root."""
    policy = PathPolicy.create([str(source.parent)], [], [])
    return base_files.write_stage(config, source, version, engines, server, policy)


def test_the_stage_is_a_copy_with_a_marker_directory_per_engine(tmp_path):
    source = checkpoint(tmp_path / "trainer", SERVED)
    config = staging.StagingConfig(tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    stage = write_stage(config, source, 3, [Engine(0, None), Engine(1, None)])
    assert sorted(p.name for p in stage.iterdir()) == [
        staging.SERVER_MARK,
        staging.BASE_MARK,
        "markers-engine0",
        "markers-engine1",
        "model.safetensors",
    ]
    digest = base_files.check_stage(stage, source, "the update")
    assert digest == digest_checkpoint(source).hexdigest()
    with pytest.raises(base_files.WeightsRefused, match=r"neither model\.safetensors"):
        write_stage(config, tmp_path / "shm", 4, [Engine(0, None)])


def test_every_misfit_is_named(tmp_path):
    served = checkpoint(tmp_path / "served", SERVED)
    bad = checkpoint(
        tmp_path / "bad",
        {"a.weight": torch.ones(4, 2, dtype=torch.float32), "c.weight": torch.zeros(1)},
    )
    with pytest.raises(base_files.WeightsRefused) as err:
        base_files.check_stage(bad, served, "the update at /bad")
    message = str(err.value)
    assert message.startswith("the update at /bad does not fit the served model")
    for says in (
        "c.weight: the served model has no such tensor",
        "b.weight: missing from the update",
        "a.weight: shape [4, 2], the served model's is [4, 3]",
        "a.weight: dtype F32, the served model's is BF16",
    ):
        assert says in message


def test_non_finite_values_are_named(tmp_path):
    served = checkpoint(tmp_path / "served", SERVED)
    b = SERVED["b.weight"].clone()
    b[1, 2] = float("inf")
    bad = checkpoint(tmp_path / "bad", {**SERVED, "b.weight": b})
    with pytest.raises(base_files.WeightsRefused, match=r"b\.weight: holds NaN or infinite"):
        base_files.check_stage(bad, served, "the update")


def test_a_long_list_of_problems_is_cut_and_counted():
    err = base_files.WeightsRefused("x", [f"t{i}: bad" for i in range(25)])
    assert "t19: bad" in str(err) and "t20" not in str(err) and "and 5 more" in str(err)
    assert len(err.problems) == 25


def test_a_final_update_removes_only_this_servers_older_base_stages(tmp_path):
    """Two servers stage in one root (both default to /dev/shm); once server A's version 5 is
    final, A's stages of 3 and 4 go (from any of A's API servers: they share A's id), A's 5
    and a later one stay, server B's stages of 1 and 4 stay (B's current version is what a
    revert of B's next update reads; before, they were removed too), and neither a LoRA
    stage nor a stage that names no server is touched."""
    source = checkpoint(tmp_path / "trainer", SERVED)
    root = tmp_path / "shm"
    root.mkdir()
    config = staging.StagingConfig(root)
    ours = {v: write_stage(config, source, v, [Engine(0, None)]) for v in (3, 4, 5, 6)}
    theirs = [write_stage(config, source, v, [Engine(0, None)], server="server-b") for v in (1, 4)]
    unnamed = staging.new_stage_dir(config, "base", 2)
    (unnamed / staging.BASE_MARK).write_text("2")  # a stage of an older plugin: no server
    lora = staging.new_stage_dir(config, "policy", 2)
    removed = staging.remove_superseded_base(root, 5, SERVER)
    assert sorted(removed) == sorted([ours[3], ours[4]])
    assert sorted(root.iterdir()) == sorted([ours[5], ours[6], *theirs, unnamed, lora])


def test_a_file_linked_out_of_the_roots_is_refused_naming_it(tmp_path):
    """The checkpoint directory lies inside the root; its `model.safetensors` is a symlink to
    a file outside it (before: copied through the link, staged and served). The same rule as
    an adapter's files (`PathPolicy.check_files`); nothing is staged."""
    allowed, outside = tmp_path / "allowed", checkpoint(tmp_path / "outside", SERVED)
    source = allowed / "ckpt"
    source.mkdir(parents=True)
    os.symlink(outside / "model.safetensors", source / "model.safetensors")
    root = tmp_path / "shm"
    root.mkdir()
    with pytest.raises(PathRefused) as err:
        write_stage(staging.StagingConfig(root), source, 3, [Engine(0, None)])
    target = (outside / "model.safetensors").resolve()
    assert f"checkpoint file {source / 'model.safetensors'} resolves to {target}" in str(err.value)
    assert list(root.iterdir()) == []


def test_an_index_or_shard_leading_out_of_the_roots_is_refused(tmp_path):
    """A sharded checkpoint: the index is checked before it is read, then each shard it
    names (here a shard name that climbs out of the directory)."""
    allowed = tmp_path / "allowed"
    checkpoint(tmp_path / "outside", SERVED)
    source = allowed / "ckpt"
    source.mkdir(parents=True)
    index = {"weight_map": {"a.weight": "../../outside/model.safetensors"}}
    (source / base_files.INDEX_FILE).write_text(json.dumps(index))
    root = tmp_path / "shm"
    root.mkdir()
    with pytest.raises(PathRefused, match="outside every allowed root"):
        write_stage(staging.StagingConfig(root), source, 3, [Engine(0, None)])
    (source / base_files.INDEX_FILE).unlink()
    os.symlink(tmp_path / "elsewhere.json", source / base_files.INDEX_FILE)
    with pytest.raises(PathRefused, match=f"checkpoint file {source / base_files.INDEX_FILE}"):
        write_stage(staging.StagingConfig(root), source, 3, [Engine(0, None)])
    assert list(root.iterdir()) == []


@pytest.mark.parametrize("cut", [1, 40, 10_000])
def test_a_truncated_file_is_named(tmp_path, cut):
    """A shard cut short (in the data, or inside its header): refused naming the file (before:
    the safetensors reader's "Error while deserializing header", answered 500)."""
    served = checkpoint(tmp_path / "served", SERVED)
    bad = checkpoint(tmp_path / "bad", SERVED)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: max(4, len(data) - cut)])
    with pytest.raises(base_files.WeightsRefused) as err:
        base_files.check_stage(bad, served, "the update at /bad")
    message = str(err.value)
    assert message.startswith("the update at /bad does not fit the served model: model.safetensors")


def test_a_file_longer_than_its_header_says_is_named(tmp_path):
    served = checkpoint(tmp_path / "served", SERVED)
    bad = checkpoint(tmp_path / "bad", SERVED)
    with open(bad / "model.safetensors", "ab") as f:
        f.write(b"\0" * 16)
    with pytest.raises(base_files.WeightsRefused, match=r"model\.safetensors: longer than its"):
        base_files.check_stage(bad, served, "the update")
