"""The staging directory within a budget (`art_vllm_plugin/staging.py`): room checked before
anything is written, a size cap, per-process stage names, and the sweep of what crashed servers
left. No server: these are the functions the API server calls (the same contract over HTTP is
in `api_server/test_adapter_push.py`).

"Less free space than the adapter" is a real small tmpfs mounted for the test (root only: the
test checks `os.geteuid()`); without root the same refusal is made to happen on a real
directory by asking for one byte more than it has free.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.adapters import copy_adapter
from support.stages import end, stage_left_by

from art_vllm_plugin import cli, staging
from art_vllm_plugin.adapters import read_adapter_files
from art_vllm_plugin.api_server import slot_publish
from art_vllm_plugin.api_server.slot_publish import Engine

REPO = Path(__file__).resolve().parents[2]


def mount_tmpfs(path: Path, options: str) -> Path:
    """A tmpfs at `path` (root only; skips otherwise). Unmount with `umount`."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (the non-root twin runs instead)")
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    return path


def umount(path: Path) -> None:
    subprocess.run(["umount", str(path)], check=False)


@pytest.fixture
def small_tmpfs(tmp_path):
    """64 KiB of tmpfs: less than one tiny adapter (about 136 KB)."""
    path = mount_tmpfs(tmp_path / "shm", "size=64k")
    yield path
    umount(path)


@pytest.fixture
def few_inodes(tmp_path):
    """A tmpfs with room for the bytes but inodes for the stage directory and one file only:
    the second file's creation fails with ENOSPC after the free-space check passed."""
    path = mount_tmpfs(tmp_path / "inodes", "size=1m,nr_inodes=3")
    yield path
    umount(path)


def test_an_adapter_larger_than_the_free_space_is_refused_naming_both(small_tmpfs, tiny_adapters):
    files = read_adapter_files(tiny_adapters / "b")
    size = len(files.config) + len(files.weights)
    config = staging.StagingConfig(small_tmpfs)
    free = staging.free_bytes(small_tmpfs)
    assert free < size, "the tmpfs must be smaller than the adapter"
    with pytest.raises(staging.StagingFull) as err:
        config.check_space(size, "adapter policy@3")
    message = str(err.value)
    assert err.value.status == 507
    needed = size + staging.STAGE_OVERHEAD_BYTES
    assert f"needs {needed} bytes in {small_tmpfs}" in message
    assert f"only {free} bytes are free" in message and "--art-staging-dir" in message
    # Through the API server's staging step: refused before a directory is made.
    with pytest.raises(staging.StagingFull):
        slot_publish._write_stage(config, "policy", 3, files, [Engine(0, None)])
    assert list(small_tmpfs.iterdir()) == []


def test_without_root_the_same_refusal_on_a_real_directory(tmp_path):
    config = staging.StagingConfig(tmp_path)
    free = staging.free_bytes(tmp_path)
    with pytest.raises(staging.StagingFull, match=f"only {free} bytes are free"):
        config.check_space(free, "adapter policy@3")  # plus the markers' overhead: too much
    config.check_space(0, "an empty adapter")  # fits


def test_a_write_that_runs_out_of_space_is_507_and_leaves_nothing(few_inodes, tiny_adapters):
    files = read_adapter_files(tiny_adapters / "b")
    config = staging.StagingConfig(few_inodes)
    with pytest.raises(staging.StagingFull) as err:
        slot_publish._write_stage(config, "policy", 3, files, [Engine(0, None)])
    assert "the file system is full" in str(err.value) and str(few_inodes) in str(err.value)
    assert "nothing was staged" in str(err.value)
    assert list(few_inodes.iterdir()) == [], "a partial stage was left behind"


def test_an_adapter_over_the_size_cap_is_refused_naming_the_limit():
    config = staging.StagingConfig(Path("/unused"), max_adapter_bytes=1000)
    assert (
        config.check_size({"adapter_config.json": 10, "adapter_model.safetensors": 990}, "a")
        == 1000
    )
    with pytest.raises(staging.AdapterTooLarge) as err:
        config.check_size({"adapter_config.json": 10, "adapter_model.safetensors": 991}, "the x")
    assert err.value.status == 413
    assert "the x is 1001 bytes" in str(err.value)
    assert "limit of 1000 bytes (--art-max-adapter-bytes)" in str(err.value)


def test_the_flags_are_typed(monkeypatch):
    parser = argparse.ArgumentParser(prog="vllm serve")
    cli.add_art_options(parser)
    args = parser.parse_args(["--art-max-adapter-bytes", "512MiB", "--art-staging-dir", "/tmp"])
    assert args.art_max_adapter_bytes == 512 * 1024**2 and args.art_staging_dir == "/tmp"
    assert parser.parse_args([]).art_max_adapter_bytes is None  # the 4 GiB default applies
    assert staging.StagingConfig.create(None, None).max_adapter_bytes == 4 * 1024**3
    for bad in (["--art-max-adapter-bytes", "0"], ["--art-max-adapter-bytes", "4 GB"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    with pytest.raises(SystemExit):
        parser.parse_args(["--art-staging-dir", "/no/such/dir"])
    monkeypatch.setenv(staging.ENV_DIR, "/no/such/dir")
    with pytest.raises(staging.StagingDirError, match="ART_STAGING_DIR /no/such/dir"):
        staging.StagingConfig.create(None, None)
    assert staging.StagingConfig.create("/tmp", None).root == Path("/tmp")  # the flag wins


# -- names and the sweep ----------------------------------------------------------------------
def test_two_servers_name_their_stages_apart(tmp_path):
    """Two server processes on one host, the same slot and version at once."""
    a, stage_a = stage_left_by(tmp_path, "live")
    b, stage_b = stage_left_by(tmp_path, "live")
    try:
        assert stage_a != stage_b
        owners = {staging.Owner.parse(s.name) for s in (stage_a, stage_b)}
        assert {o.pid for o in owners} == {a.pid, b.pid}
        assert all(o.alive() and o.ours_to_judge() for o in owners)
        assert staging.sweep(tmp_path) == [], "a live server's stage was removed"
    finally:
        end(a)
        end(b)


def test_a_sigkilled_servers_stage_is_swept_and_nothing_else(tmp_path, caplog):
    _, dead = stage_left_by(tmp_path, "kill")
    live_proc, live = stage_left_by(tmp_path, "live")
    mine = staging.new_stage_dir(staging.StagingConfig(tmp_path), "policy", 1)
    dead_owner = staging.Owner.parse(dead.name)
    # Same dead pid, but another PID namespace: that pid means nothing here.
    foreign = tmp_path / f"{staging.PREFIX}{dead_owner.pid}.1.{dead_owner.namespace + 1}-p-1-x"
    foreign.mkdir()
    # A live pid that started at another time than the name says: the pid was reused.
    reused = tmp_path / f"{staging.PREFIX}{live_proc.pid}.1.{dead_owner.namespace}-p-1-x"
    reused.mkdir()
    unrelated = tmp_path / "art-stage-of-someone-else"
    unrelated.mkdir()
    not_a_dir = tmp_path / f"{staging.PREFIX}{dead_owner.pid}-file"
    not_a_dir.write_text("")
    others = []
    if os.geteuid() == 0:  # a dead owner's stage of another uid stays (only root can make one)
        other_uid = tmp_path / f"{staging.PREFIX}{dead_owner.pid}-other-uid"
        other_uid.mkdir()
        os.chown(other_uid, 65534, 65534)
        others.append(other_uid)
    try:
        with caplog.at_level("WARNING", logger="vllm.art_plugin.staging"):
            removed = staging.sweep(tmp_path)
        assert sorted(removed) == sorted([dead, reused])
        assert not dead.exists() and not reused.exists()
        for kept in (live, mine, foreign, unrelated, not_a_dir, *others):
            assert kept.exists(), kept
        assert str(dead) in caplog.text and "left by processes that are gone" in caplog.text
        assert staging.sweep(tmp_path) == []
    finally:
        end(live_proc)


def test_old_style_names_are_judged_by_their_pid(tmp_path):
    """Stages named by servers before the owner tag (`art-stage-<pid>-...`)."""
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    gone = tmp_path / f"{staging.PREFIX}{int(proc.stdout)}-policy-3-abcd1234"
    gone.mkdir()
    ours = tmp_path / f"{staging.PREFIX}{os.getpid()}-policy-3-abcd1234"
    ours.mkdir()
    assert staging.sweep(tmp_path) == [gone] and ours.exists()


def test_a_stage_holds_the_files_and_one_marker_directory_per_engine(tiny_adapters, tmp_path):
    files = read_adapter_files(copy_adapter(tiny_adapters / "b", tmp_path / "b"))
    stage = slot_publish._write_stage(
        staging.StagingConfig(tmp_path), "policy", 1, files, [Engine(0, None), Engine(1, None)]
    )
    used = sum(p.stat().st_size for p in stage.rglob("*") if p.is_file())
    assert used == len(files.config) + len(files.weights)
    assert {p.name for p in stage.iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
        "markers-engine0",
        "markers-engine1",
    }
    staging.remove(stage)
