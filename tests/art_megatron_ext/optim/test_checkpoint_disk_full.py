"""Disk full: ENOSPC injected at every write point of a save; the last commit still loads."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from art_megatron_ext.optim import CheckpointConfig, CheckpointIO, ShardedCheckpointer


class FailingIO(CheckpointIO):
    """Records every write point and raises ENOSPC at the `fail_at`-th one."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.points: list[str] = []

    def _point(self, what: str) -> None:
        self.points.append(what)
        if len(self.points) - 1 == self.fail_at:
            raise OSError(errno.ENOSPC, "No space left on device (injected)", what)

    def write(self, f, data):
        self._point(f"write {f.name}")
        super().write(f, data)

    def fsync(self, f):
        self._point(f"fsync {f.name}")
        super().fsync(f)

    def replace(self, src, dst):
        self._point(f"replace {dst}")
        super().replace(src, dst)

    def fsync_dir(self, directory):
        self._point(f"fsync_dir {directory}")
        super().fsync_dir(directory)


class CommittedStaysLoadable(CheckpointIO):
    """At the commit rename, the generation being replaced must still load intact."""

    def __init__(self, directory) -> None:
        self.directory = directory
        self.committed_value: float | None = None

    def replace(self, src, dst):
        if dst.name == "CURRENT.json":
            self.committed_value = load_value(self.directory)
        super().replace(src, dst)


def state(tag: float) -> dict:
    return {"moments": torch.full((4096,), tag), "bias": torch.arange(8) + int(tag)}


def save(directory, value, io=None):
    return ShardedCheckpointer(CheckpointConfig(directory), io=io).save(
        state(value), step=int(value), objective="rl"
    )


def load_value(directory) -> float:
    loaded = ShardedCheckpointer(CheckpointConfig(directory)).load()
    moments, bias = loaded.state["moments"], loaded.state["bias"]
    value = float(moments[0])
    assert torch.equal(moments, torch.full((4096,), value)), "mixed content"
    assert torch.equal(bias, torch.arange(8) + int(value)), "mixed content"
    assert loaded.step == int(value)
    return value


def write_points(tmp_path) -> list[str]:
    probe = tmp_path / "probe"
    save(probe, 1.0)
    io = FailingIO()
    save(probe, 2.0, io=io)
    return io.points


def test_every_write_point_is_exercised(tmp_path):
    points = write_points(tmp_path)
    kinds = {p.split()[0] for p in points}
    assert kinds == {"write", "fsync", "replace", "fsync_dir"}
    assert points[-2].startswith("replace") and points[-2].endswith("CURRENT.json")
    assert len(points) >= 8


def test_enospc_at_each_write_point_raises_and_last_commit_still_loads(tmp_path):
    points = write_points(tmp_path)
    manifest_replace = len(points) - 2
    for index, point in enumerate(points):
        directory = tmp_path / f"case{index}"
        save(directory, 1.0)
        checkpointer = ShardedCheckpointer(CheckpointConfig(directory), io=FailingIO(index))
        with pytest.raises(OSError) as info:
            checkpointer.save(state(2.0), step=2, objective="rl")
        assert info.value.errno == errno.ENOSPC, point
        value = load_value(directory)
        if index <= manifest_replace:
            assert value == 1.0, f"failure at {point} changed the committed generation"
        else:  # only the directory fsync after the manifest rename: new commit, not durable
            assert value == 2.0, point
        assert not list(directory.glob("*.tmp")), f"temporary file left after {point}"
        # The same checkpointer recovers, and never overwrites a committed shard meanwhile.
        checkpointer.io = CommittedStaysLoadable(directory)
        checkpointer.save(state(3.0), step=3, objective="rl")
        assert checkpointer.io.committed_value == value
        assert load_value(directory) == 3.0
        assert len(list(directory.glob("gen-*.pt"))) == 1


@pytest.mark.parametrize(
    ("code", "raises"), [(errno.EINVAL, False), (errno.ENOTSUP, False), (errno.EIO, True)]
)
def test_directory_fsync_unsupported_is_tolerated_but_io_errors_raise(
    tmp_path, monkeypatch, code, raises
):
    real_fsync = os.fsync

    def fsync(fd):
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(code, os.strerror(code))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    if raises:
        with pytest.raises(OSError) as info:
            save(tmp_path, 1.0)
        assert info.value.errno == code
    else:
        save(tmp_path, 1.0)
        assert load_value(tmp_path) == 1.0
