"""Background saves: the caller waits only for the snapshot; commits stay ordered and atomic."""

from __future__ import annotations

import errno
import threading

import pytest
import torch

from art_megatron_ext.optim import (
    AsyncCheckpointer,
    CheckpointConfig,
    CheckpointIO,
    PeriodicSaver,
    SaveSchedule,
    ShardedCheckpointer,
    snapshot_state,
)


def state(value: float) -> dict:
    return {"moments": torch.full((4096,), value), "nested": [torch.arange(8) + int(value)]}


def loaded_value(directory) -> float | None:
    loaded = ShardedCheckpointer(CheckpointConfig(directory)).load()
    if loaded is None:
        return None
    value = float(loaded.state["moments"][0])
    assert torch.equal(loaded.state["moments"], torch.full((4096,), value)), "mixed content"
    assert loaded.step == int(value)
    return value


class GatedIO(CheckpointIO):
    """Shard writes block until `gate` is set; records the order of writes and commits."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.writing = threading.Event()
        self.events: list[str] = []

    def write(self, f, data):
        if ".rank-" in f.name:
            self.writing.set()
            assert self.gate.wait(60), "test never opened the gate"
            self.events.append(f"write {f.name.split('/')[-1].split('.')[0]}")
        super().write(f, data)

    def replace(self, src, dst):
        if dst.name == "CURRENT.json":
            self.events.append("commit")
        super().replace(src, dst)


def test_save_returns_after_the_snapshot_while_the_write_is_still_blocked(tmp_path):
    ShardedCheckpointer(CheckpointConfig(tmp_path)).save(state(1.0), step=1, objective="rl")
    io = GatedIO()
    background = AsyncCheckpointer(ShardedCheckpointer(CheckpointConfig(tmp_path), io=io))
    live = state(2.0)
    future = background.save(live, step=2, objective="rl")
    assert io.writing.wait(30)  # the background thread is inside the shard write
    assert not future.done()
    assert loaded_value(tmp_path) == 1.0  # readers still see the last commit
    live["moments"].fill_(-7.0)  # the loop goes on changing its tensors
    live["nested"][0].zero_()
    io.gate.set()
    manifest = background.close()
    assert manifest.step == 2 and future.done()
    assert loaded_value(tmp_path) == 2.0  # the snapshot was committed, not the live tensors


def test_the_next_save_waits_for_the_previous_commit(tmp_path):
    io = GatedIO()
    io.gate.set()
    background = AsyncCheckpointer(ShardedCheckpointer(CheckpointConfig(tmp_path), io=io))
    for step in (1, 2, 3):
        background.save(state(float(step)), step=step, objective="rl")
    background.close()
    collapsed = [e for i, e in enumerate(io.events) if i == 0 or io.events[i - 1] != e]
    # every write of generation N+1 comes after the commit of generation N
    assert [e.split()[0] for e in collapsed] == ["write", "commit"] * 3, io.events
    assert len({e for e in collapsed if e.startswith("write")}) == 3
    assert loaded_value(tmp_path) == 3.0


class FailShardFsync(CheckpointIO):
    def __init__(self) -> None:
        self.armed = True

    def fsync(self, f):
        if self.armed and ".rank-" in f.name:
            self.armed = False
            raise OSError(errno.ENOSPC, "No space left on device (injected)", f.name)
        super().fsync(f)


def test_a_failed_background_save_raises_at_the_next_save_and_keeps_the_last_commit(tmp_path):
    ShardedCheckpointer(CheckpointConfig(tmp_path)).save(state(1.0), step=1, objective="rl")
    background = AsyncCheckpointer(
        ShardedCheckpointer(CheckpointConfig(tmp_path), io=FailShardFsync())
    )
    background.save(state(2.0), step=2, objective="rl")
    with pytest.raises(OSError) as info:
        background.save(state(3.0), step=3, objective="rl")
    assert info.value.errno == errno.ENOSPC
    assert loaded_value(tmp_path) == 1.0
    assert background.pending_step is None  # nothing was queued by the refused call
    background.save(state(3.0), step=3, objective="rl")  # the error was reported once
    background.close()
    assert loaded_value(tmp_path) == 3.0


def test_clean_stop_of_an_async_saver_waits_for_the_last_commit(tmp_path):
    io = GatedIO()
    background = AsyncCheckpointer(ShardedCheckpointer(CheckpointConfig(tmp_path), io=io))
    committed_at_exit = []

    def save(step: int) -> None:
        background.save(state(float(step)), step=step, objective="rl")
        io.gate.set()  # let the writer run once something is queued

    saver = PeriodicSaver(save, SaveSchedule(5), drain=background.wait)
    with saver:
        for step in range(1, 8):
            saver.step_done(step)
    committed_at_exit.append(loaded_value(tmp_path))
    assert committed_at_exit == [7.0]
    assert background.pending_step is None
    background.close()


def test_snapshot_copies_views_as_their_own_elements():
    base = torch.arange(1 << 16, dtype=torch.float32)
    view = base[10:20]
    snap = snapshot_state({"v": view, "t": (base[:2],), "n": 3, "s": "x"})
    assert torch.equal(snap["v"], view) and snap["v"].untyped_storage().nbytes() == 40
    base.zero_()
    assert snap["v"][0] == 10.0 and snap["t"][0][1] == 1.0
    assert snap["n"] == 3 and snap["s"] == "x"
