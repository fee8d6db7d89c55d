"""`progress` of `GET /art/v1/weights` while a full-weight update stages
(`api_server/base_progress.py`).

The API server's own reading code against real progress files in a temporary stage, written
as workers write them (`stage_progress.Recorder`); the engines are local, so the progress is
read from files, never from an engine (an engine of several workers answers no call while it
receives a stream between steps). The reads that do go to the engines are bounded while an
update runs: a read that hangs (as an engine stuck in a stream does) is answered from the last
one within `ENGINE_READ_S`.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from art_vllm_plugin import stage_progress, staging
from art_vllm_plugin.api_server import base_progress, slot_publish
from art_vllm_plugin.api_server.stage_deadline import StallRule

pytestmark = pytest.mark.serve

ENGINES = [slot_publish.Engine(0, b"\x00\x00"), slot_publish.Engine(1, b"\x01\x00")]


def running(stage_dir: Path) -> base_progress.RunningStage:
    return base_progress.RunningStage(7, "t", stage_dir, StallRule(30.0, 4096, 8))


def test_no_progress_is_shown_when_no_update_runs(tmp_path):
    assert asyncio.run(base_progress.StageProgress(None, ENGINES, 30.0).view()) is None


def test_each_engine_shows_its_bytes_of_the_total_tensors_and_idle_seconds(tmp_path):
    progress = base_progress.StageProgress(None, ENGINES, 30.0)
    progress.running = running(tmp_path)
    for rank, nbytes in ((0, 1024), (1, 512)):
        recorder = stage_progress.Recorder(staging.marker_dir(tmp_path, 0), rank)
        recorder.add(nbytes, tensors=2)
        recorder.write()
    staging.marker_dir(tmp_path, 1)  # engine 1's workers have not started
    view = asyncio.run(progress.view())
    assert view["version"] == 7 and view["stall_timeout_s"] == 30.0 and view["running_s"] >= 0
    zero, one = view["engines"]
    assert (zero["engine"], zero["bytes"], zero["total_bytes"]) == (0, 512, 4096)
    assert (zero["tensors"], zero["total_tensors"]) == (2, 8)
    assert 0 <= zero["idle_s"] < 30.0
    assert [(w["rank"], w["bytes"]) for w in zero["workers"]] == [(0, 1024), (1, 512)]
    assert one == {
        "engine": 1,
        "bytes": 0,
        "total_bytes": 4096,
        "tensors": 0,
        "total_tensors": 8,
        "idle_s": None,
        "workers": [],
    }


def test_while_an_update_runs_a_hanging_engine_read_is_answered_within_the_bound(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(base_progress, "ENGINE_READ_S", 0.2)
    progress = base_progress.StageProgress(None, ENGINES, 30.0)
    reads = []

    async def hanging_read():
        reads.append(time.monotonic())
        await asyncio.sleep(1.0)
        return "figures"

    async def run():
        progress.running = running(tmp_path)
        t0 = time.monotonic()
        first = await progress.bounded(hanging_read)
        second = await progress.bounded(hanging_read)  # the same read still in flight
        bounded_s = time.monotonic() - t0
        progress.running = None
        third = await progress.bounded(hanging_read)  # the update ended: a fresh read, whole
        return first, second, bounded_s, third

    first, second, bounded_s, third = asyncio.run(run())
    assert first == second == (False, None) and bounded_s < 0.9
    assert third == (True, "figures") and len(reads) == 2
