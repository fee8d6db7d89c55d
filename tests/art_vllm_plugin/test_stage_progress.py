"""A worker's progress record beside its markers (`art_vllm_plugin.stage_progress`).

Real files in a temporary marker directory; the wall clock is passed in, so which `add`
writes the file is decided by the test, not by the host's speed.
"""

from __future__ import annotations

import json
import time

import pytest

from art_protocol.checkpoint_layout import TensorSpec
from art_vllm_plugin import stage_progress

pytestmark = pytest.mark.serve


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def on_disk(marker_dir, rank: int) -> dict:
    return json.loads(stage_progress.path(marker_dir, rank).read_text())


def test_the_record_is_written_at_start_then_at_most_every_quarter_second(tmp_path):
    clock = Clock()
    recorder = stage_progress.Recorder(tmp_path, 3, clock=clock, flush_later=False)
    assert on_disk(tmp_path, 3) == {"bytes": 0, "tensors": 0, "at": 1000.0}
    clock.now += 0.1
    recorder.add(100)
    clock.now += 0.1
    recorder.add(50)
    assert on_disk(tmp_path, 3)["bytes"] == 0  # two small tensors: no write yet
    clock.now += 0.1  # 0.3 s after the last write
    recorder.add(25)
    assert on_disk(tmp_path, 3) == {"bytes": 175, "tensors": 3, "at": pytest.approx(1000.3)}
    clock.now += 0.01
    recorder.add(5)
    recorder.write()  # the end of the stage: the last tensor is counted
    assert on_disk(tmp_path, 3) == {"bytes": 180, "tensors": 4, "at": pytest.approx(1000.31)}
    assert [p.name for p in tmp_path.iterdir()] == ["progress.3"]  # no temporary file left


def test_the_last_tensors_before_a_pause_reach_the_file(tmp_path):
    """Without a later write they would not: the stall's message would understate them."""
    recorder = stage_progress.Recorder(tmp_path, 0)
    recorder.add(100)  # within a quarter second of the first write: left to the timer
    recorder.add(20)
    deadline = time.monotonic() + 30.0  # a ceiling for a loaded host, not a timing check
    while on_disk(tmp_path, 0)["tensors"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (on_disk(tmp_path, 0)["bytes"], on_disk(tmp_path, 0)["tensors"]) == (120, 2)


def test_a_read_gives_each_records_age_and_leaves_out_workers_without_one(tmp_path):
    clock = Clock()
    recorder = stage_progress.Recorder(tmp_path, 0, clock=clock)
    clock.now += 2.0
    recorder.add(64, tensors=2)
    (tmp_path / "ready.1").write_text("")
    got = stage_progress.read(tmp_path, [0, 1], now=clock.now + 1.5)
    assert got == {0: stage_progress.Progress(0, 64, 2, 1.5)}
    assert stage_progress.read(tmp_path, None, now=clock.now) == {
        0: stage_progress.Progress(0, 64, 2, 0.0)
    }
    assert stage_progress.Progress.from_json(got[0].to_json()) == got[0]


def test_a_record_for_a_removed_stage_is_dropped_quietly(tmp_path):
    gone = tmp_path / "markers-engine0"
    gone.mkdir()
    recorder = stage_progress.Recorder(gone, 0)
    gone.joinpath("progress.0").unlink()
    gone.rmdir()  # the update ended and its stage was removed
    recorder.add(1, tensors=1)
    recorder.write()
    assert stage_progress.read(gone) == {}


def test_an_updates_size_is_counted_in_its_checkpoint_form():
    layout = {
        "a": TensorSpec("BF16", (4, 8)),
        "b": TensorSpec("F32", (3,)),
        "c": TensorSpec("F8_E4M3", (5,)),
        "d": TensorSpec("BOOL", (2,)),
    }
    assert stage_progress.layout_totals(layout) == (4 * 8 * 2 + 3 * 4 + 5 + 2, 4)
    plan = {"names": ["a", "b"], "dtypes": ["bfloat16", "float32"], "shapes": [[4, 8], [3]]}
    assert stage_progress.plan_totals(plan) == (4 * 8 * 2 + 3 * 4, 2)
    with pytest.raises(ValueError, match="unknown safetensors dtype 'Q4'"):
        stage_progress.element_bytes("Q4")
