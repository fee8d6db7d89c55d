"""ShardedCheckpointer on one process: commit protocol, verification, legacy layout."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
import xxhash

from art_megatron_ext.optim import (
    CheckpointConfig,
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointIO,
    CheckpointWorldSizeError,
    ShardedCheckpointer,
)
from art_megatron_ext.optim.fileio import file_digest


def make_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 8, generator=g),
        "half": torch.randn(33, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 1000, (17,), generator=g),
        "step": seed,
        "nested": {"lr": 1e-4, "names": ["a", "b"]},
    }


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype
            assert torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8)), key
        else:
            assert a[key] == b[key], key


def checkpointer(directory, **kwargs) -> ShardedCheckpointer:
    return ShardedCheckpointer(CheckpointConfig(directory), **kwargs)


def test_empty_directory_loads_nothing(tmp_path):
    assert checkpointer(tmp_path / "absent").load() is None
    assert checkpointer(tmp_path).load() is None


def test_round_trip_is_bit_exact_and_manifest_describes_the_shard(tmp_path):
    state = make_state(1)
    manifest = checkpointer(tmp_path).save(state, step=5, objective="rl")
    loaded = checkpointer(tmp_path).load()
    assert_same(state, loaded.state)
    assert (loaded.step, loaded.objective, loaded.legacy) == (5, "rl", False)

    body = json.loads((tmp_path / "CURRENT.json").read_text())
    assert body["step"] == 5 and body["world_size"] == 1 and body["objective"] == "rl"
    (entry,) = body["files"]
    shard = tmp_path / entry["name"]
    assert entry["size"] == shard.stat().st_size
    assert body["format_version"] == 2 and body["digest"] == "xxh3-128"
    assert entry["digest"] == file_digest(shard.read_bytes())
    assert entry["digest"] == xxhash.xxh3_128(shard.read_bytes()).hexdigest()
    assert manifest.files[0].name == entry["name"]


def test_commit_removes_the_previous_generation_and_crash_debris(tmp_path):
    ck = checkpointer(tmp_path)
    first = ck.save(make_state(1), step=1, objective="rl")
    (tmp_path / "gen-00000009.rank-00000-of-00001.pt.tmp").write_bytes(b"half written")
    (tmp_path / "unrelated.txt").write_text("not ours")
    second = ck.save(make_state(2), step=2, objective="rl")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(["CURRENT.json", second.files[0].name, "unrelated.txt"])
    assert first.files[0].name != second.files[0].name


class InspectAtManifestReplace(CheckpointIO):
    """Checks, at the moment the manifest is replaced, what a reader would see."""

    def __init__(self, directory, old_state):
        self.directory, self.old_state, self.seen = directory, old_state, None

    def replace(self, src, dst):
        if dst.name == "CURRENT.json":
            old = checkpointer(self.directory).load()
            assert_same(self.old_state, old.state)
            self.seen = old.step
        super().replace(src, dst)


def test_previous_generation_stays_committed_until_the_manifest_advances(tmp_path):
    old = make_state(1)
    checkpointer(tmp_path).save(old, step=1, objective="rl")
    io = InspectAtManifestReplace(tmp_path, old)
    checkpointer(tmp_path, io=io).save(make_state(2), step=2, objective="rl")
    assert io.seen == 1  # the new shard was complete on disk, yet readers saw step 1
    assert_same(make_state(2), checkpointer(tmp_path).load().state)


def test_a_shard_not_in_the_manifest_is_ignored(tmp_path):
    state = make_state(3)
    checkpointer(tmp_path).save(state, step=3, objective="rl")
    torch.save(make_state(99), tmp_path / "gen-00000099.rank-00000-of-00001.pt")
    torch.save(make_state(98), tmp_path / "00-of-01.pt")  # a stale legacy shard too
    assert_same(state, checkpointer(tmp_path).load().state)


def _only_shard(tmp_path):
    (shard,) = tmp_path.glob("gen-*.pt")
    return shard


def test_digest_mismatch_names_the_file(tmp_path):
    checkpointer(tmp_path).save(make_state(4), step=4, objective="rl")
    shard = _only_shard(tmp_path)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="xxh3-128 digest") as info:
        checkpointer(tmp_path).load()
    assert str(shard) in str(info.value)


def test_truncated_or_missing_shard_names_the_file(tmp_path):
    checkpointer(tmp_path).save(make_state(5), step=5, objective="rl")
    shard = _only_shard(tmp_path)
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointCorruptError, match="size") as info:
        checkpointer(tmp_path).load()
    assert str(shard) in str(info.value)
    shard.unlink()
    with pytest.raises(CheckpointCorruptError, match="missing") as info:
        checkpointer(tmp_path).load()
    assert str(shard) in str(info.value)


def test_malformed_manifest_is_a_format_error_naming_it(tmp_path):
    checkpointer(tmp_path).save(make_state(6), step=6, objective="rl")
    (tmp_path / "CURRENT.json").write_text('{"format": "art-pipeline/sharded-checkpoint"')
    with pytest.raises(CheckpointFormatError, match=r"CURRENT\.json"):
        checkpointer(tmp_path).load()


def test_manifest_naming_a_path_outside_the_directory_is_refused(tmp_path):
    checkpointer(tmp_path).save(make_state(6), step=6, objective="rl")
    body = json.loads((tmp_path / "CURRENT.json").read_text())
    body["files"][0]["name"] = "../elsewhere.pt"
    (tmp_path / "CURRENT.json").write_text(json.dumps(body))
    with pytest.raises(CheckpointFormatError, match="elsewhere"):
        checkpointer(tmp_path).load()


def test_world_size_change_is_refused_with_a_clear_message(tmp_path):
    checkpointer(tmp_path).save(make_state(7), step=7, objective="rl")
    body = json.loads((tmp_path / "CURRENT.json").read_text())
    body["world_size"] = 2
    body["files"].append(dict(body["files"][0], rank=1))
    (tmp_path / "CURRENT.json").write_text(json.dumps(body))
    with pytest.raises(CheckpointWorldSizeError, match="saved by 2 ranks but this job has 1"):
        checkpointer(tmp_path).load()


def test_legacy_shards_load_and_the_next_save_upgrades_them(tmp_path):
    legacy = make_state(8)
    torch.save(legacy, tmp_path / "00-of-01.pt")
    ck = checkpointer(tmp_path)
    loaded = ck.load()
    assert loaded.legacy and loaded.step is None and loaded.objective is None
    assert_same(legacy, loaded.state)

    ck.save(make_state(9), step=9, objective="rl")
    assert not (tmp_path / "00-of-01.pt").exists()
    again = checkpointer(tmp_path).load()
    assert not again.legacy and again.step == 9
    assert_same(make_state(9), again.state)


def test_legacy_shards_of_another_world_size_or_incomplete_are_refused(tmp_path):
    torch.save(make_state(1), tmp_path / "00-of-02.pt")
    with pytest.raises(CheckpointFormatError, match="incomplete"):
        checkpointer(tmp_path).load()
    torch.save(make_state(2), tmp_path / "01-of-02.pt")
    with pytest.raises(CheckpointWorldSizeError, match="saved by 2 ranks"):
        checkpointer(tmp_path).load()


def test_generations_keep_increasing_across_checkpointer_objects(tmp_path):
    first = checkpointer(tmp_path).save(make_state(1), step=10, objective="rl")
    second = checkpointer(tmp_path).save(make_state(1), step=10, objective="rl")
    assert second.generation == first.generation + 1


def test_negative_step_is_refused(tmp_path):
    with pytest.raises(ValueError, match="step"):
        checkpointer(tmp_path).save(make_state(1), step=-1, objective="rl")
    assert not (tmp_path / "CURRENT.json").exists()


def test_corruption_that_breaks_deserialization_is_still_reported_as_a_digest_mismatch(tmp_path):
    checkpointer(tmp_path).save(make_state(4), step=4, objective="rl")
    shard = _only_shard(tmp_path)
    data = bytearray(shard.read_bytes())
    data[:4] = b"XXXX"  # no longer a zip archive: torch.load itself fails
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="xxh3-128 digest") as info:
        checkpointer(tmp_path).load()
    assert str(shard) in str(info.value)
    assert info.value.__cause__ is not None  # the deserializer's error is kept as the cause


def test_format_1_manifest_with_blake2b_digests_still_loads_and_the_next_save_upgrades(tmp_path):
    """A directory committed by the previous release (format 1, BLAKE2b-256) stays readable."""
    state = make_state(11)
    name = "gen-00000004.rank-00000-of-00001.pt"
    torch.save(state, tmp_path / name)
    data = (tmp_path / name).read_bytes()
    body = {
        "format": "art-pipeline/sharded-checkpoint",
        "format_version": 1,
        "generation": 4,
        "step": 40,
        "world_size": 1,
        "objective": "rl",
        "digest": "blake2b-256",
        "files": [
            {
                "rank": 0,
                "name": name,
                "size": len(data),
                "blake2b": hashlib.blake2b(data, digest_size=32).hexdigest(),
            }
        ],
    }
    (tmp_path / "CURRENT.json").write_text(json.dumps(body))
    loaded = checkpointer(tmp_path).load()
    assert loaded.step == 40 and loaded.generation == 4
    assert_same(state, loaded.state)
    data = bytearray(data)
    data[len(data) // 2] ^= 1
    (tmp_path / name).write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="blake2b-256 digest"):
        checkpointer(tmp_path).load()
    checkpointer(tmp_path).save(make_state(12), step=41, objective="rl")
    upgraded = json.loads((tmp_path / "CURRENT.json").read_text())
    assert upgraded["format_version"] == 2 and upgraded["generation"] == 5
    assert not (tmp_path / name).exists()
