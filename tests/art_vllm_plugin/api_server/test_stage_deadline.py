"""A full-weight stage ends when it stalls, not at a fixed time (`api_server/stage_deadline.py`).

The API server's own waiting code (`slot_publish.wait_staged`) against real marker and progress
files in a temporary stage (`staging`, `stage_progress`), written as the workers write them;
the engines are local, so nothing here calls an engine. The old fixed deadline
(`STAGE_TIMEOUT_S`) is made a fraction of a second and the stall window a second, so both
cases happen within seconds: a worker that keeps receiving outlives both, and one that stops
is ended by a message naming its engine, its rank and the bytes it received of the total.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from art_vllm_plugin import stage_progress, staging
from art_vllm_plugin.api_server import slot_publish
from art_vllm_plugin.api_server.stage_deadline import (
    EngineSeen,
    StallRule,
    StallWatch,
)

pytestmark = pytest.mark.serve

ENGINES = [slot_publish.Engine(0, b"\x00\x00"), slot_publish.Engine(1, b"\x01\x00")]
RANKS = [[0, 1], [0]]
TOTAL_BYTES, TOTAL_TENSORS = 4096, 8


def wait(stage_dir, watch, ranks=RANKS):
    return slot_publish.wait_staged(
        None, stage_dir, ENGINES, ranks, "the full weights", "old weights serve", "t", watch
    )


def markers(stage_dir, engine: int):
    return staging.marker_dir(stage_dir, engine)


async def keep_receiving(recorder: stage_progress.Recorder, seconds: float) -> None:
    """A worker receiving a 128-byte tensor every 50 ms for `seconds`."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        recorder.add(128)
        await asyncio.sleep(0.05)
    recorder.write()


def test_a_stage_that_keeps_receiving_outlives_the_old_deadline_and_the_stall_window(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(slot_publish, "STAGE_TIMEOUT_S", 0.2)
    watch = StallWatch(StallRule(1.0, TOTAL_BYTES, TOTAL_TENSORS))
    for engine, ranks in enumerate(RANKS):
        for rank in ranks:
            if (engine, rank) != (0, 1):
                staging.mark(markers(tmp_path, engine), rank, True)

    async def run() -> float:
        t0 = time.monotonic()
        recorder = stage_progress.Recorder(markers(tmp_path, 0), 1)
        waiting = asyncio.create_task(wait(tmp_path, watch))
        await keep_receiving(recorder, 2.0)
        assert not waiting.done(), "the wait ended while the worker was receiving"
        staging.mark(markers(tmp_path, 0), 1, True)
        await asyncio.wait_for(waiting, 10)  # raises if it ended the stage
        return time.monotonic() - t0

    assert asyncio.run(run()) >= 2.0


def test_a_stall_ends_the_stage_naming_engine_rank_and_bytes_received(tmp_path):
    watch = StallWatch(StallRule(0.5, TOTAL_BYTES, TOTAL_TENSORS))
    staging.mark(markers(tmp_path, 0), 0, True)  # engine 0 rank 0 is done
    recorder = stage_progress.Recorder(markers(tmp_path, 0), 1)
    for nbytes in (400, 300, 300):
        recorder.add(nbytes)
    recorder.write()  # 1000 bytes in 3 tensors, then nothing
    staging.mark(markers(tmp_path, 1), 0, True)  # engine 1 is done

    t0 = time.monotonic()
    with pytest.raises(slot_publish.PublishError) as err:
        asyncio.run(asyncio.wait_for(wait(tmp_path, watch), 10))
    waited = time.monotonic() - t0
    assert err.value.status == 500 and not err.value.state_unknown
    message = err.value.message
    assert "staging the full weights stalled: engine 0 received nothing for" in message
    assert "worker rank 1: 1000 of 4096 bytes and 3 of 8 tensors" in message
    assert "worker rank 0" not in message and "engine 1" not in message  # those were done
    assert "--art-weights-stall-timeout" in message and message.endswith("old weights serve")
    assert 0.5 <= waited < 5.0


def test_a_failed_worker_still_ends_the_stage_at_once(tmp_path):
    watch = StallWatch(StallRule(60.0, TOTAL_BYTES, TOTAL_TENSORS))
    stage_progress.Recorder(markers(tmp_path, 0), 0)
    staging.mark(markers(tmp_path, 0), 1, False, "engine\nConnectionError: peer gone")
    with pytest.raises(slot_publish.PublishError) as err:
        asyncio.run(asyncio.wait_for(wait(tmp_path, watch), 10))
    assert "engine 0 worker rank 1 failed to stage" in err.value.message
    assert "peer gone" in err.value.message


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def progress(rank, nbytes, tensors, idle):
    return stage_progress.Progress(rank, nbytes, tensors, idle)


def test_an_engine_stalls_only_when_none_of_its_waiting_workers_moved():
    clock = Clock()
    watch = StallWatch(StallRule(2.0, TOTAL_BYTES, TOTAL_TENSORS), clock=clock)
    clock.now += 3.0
    moving = EngineSeen(0, [0, 1], {0: progress(0, 512, 2, 0.5), 1: progress(1, 256, 1, 9.0)})
    silent = EngineSeen(1, [0], {})
    stalled = watch.stalled([moving, silent])
    assert stalled.startswith(
        "engine 1 received nothing for 3.0 s (worker rank 0: 0 of 4096 bytes and 0 of 8 tensors), "
        "past the stall window of 2 s (--art-weights-stall-timeout); still staging then: "
        "engine 0 received nothing for 0.5 s (worker rank 0: 512 of 4096 bytes"
    )
    assert watch.stalled([moving]) is None  # rank 0 moved half a second ago
    both = EngineSeen(0, [0, 1], {0: progress(0, 512, 2, 2.5), 1: progress(1, 256, 1, 9.0)})
    stalled = watch.stalled([both])
    # idle counts from the wait's start at most (3 s), the less idle worker decides (2.5 s)
    assert stalled.startswith("engine 0 received nothing for 2.5 s (worker rank 0: 512 of")
    assert "worker rank 1: 256 of 4096 bytes and 1 of 8 tensors" in stalled


def test_before_its_stage_call_answers_an_engine_is_judged_by_the_records_it_left():
    clock = Clock()
    watch = StallWatch(StallRule(2.0), clock=clock)
    clock.now += 1.0
    assert watch.idle_s(EngineSeen(0, None, {})) == 1.0  # nothing started: since the start
    assert watch.idle_s(EngineSeen(0, [], {0: progress(0, 8, 1, 5.0)})) == 0.0  # all done


def test_a_stall_window_must_be_positive():
    with pytest.raises(ValueError, match="--art-weights-stall-timeout"):
        StallRule(0.0)
