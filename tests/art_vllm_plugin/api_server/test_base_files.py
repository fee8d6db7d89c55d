"""A full-weight update's files, copied to a stage and checked there (`api_server/base_files.py`):
the copy is the trainer's checkpoint with one marker directory per engine, and every misfit
against the served checkpoint (names, shapes, dtypes, non-finite values) is named before any
engine sees the files. No server: the API server calls these on a thread."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from art_protocol.weights_digest import digest_checkpoint
from art_vllm_plugin import staging
from art_vllm_plugin.api_server import base_files
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
    return base_files.write_stage(config, source, version, engines, server)


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
