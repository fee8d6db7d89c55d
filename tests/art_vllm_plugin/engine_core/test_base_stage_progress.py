"""An engine says how far its workers got staging a full-weight update (`art_stage_progress`).

Read by `GET /art/v1/weights` of an API server that does not run the update (vLLM starts one
API server per DP engine by default), and by the one that does for an engine on another
host (its stall deadline). A stand-in engine (`support.stand_in_engine`); the records are real
files, as the workers write them (`stage_progress.Recorder`).
"""

from __future__ import annotations

import pytest
from support.stand_in_engine import stand_in_engine

from art_vllm_plugin import stage_progress
from art_vllm_plugin.engine_core import base_updates

pytestmark = pytest.mark.serve


def test_an_engine_says_how_far_its_workers_got_on_the_stage_it_holds(tmp_path):
    """What `GET /art/v1/weights` of an API server that does not run the update shows, and
    what the one that does reads of an engine on another host: the records in the marker
    directory on the engine's host, their ages on its clock, the plan's total."""
    core, _ = stand_in_engine(has_requests=False)
    plan = {"round": "r", "names": ["a", "b"], "dtypes": ["bfloat16", "float32"]}
    plan["shapes"] = [[4, 8], [3]]
    assert base_updates.art_stage_progress(core) is None  # nothing staged
    res = base_updates.art_stage_base_update(core, "stream", plan, 1, str(tmp_path), None)
    assert res["ok"] and res["ranks"] == [0]
    recorder = stage_progress.Recorder(tmp_path, 0)
    recorder.add(64, tensors=1)
    recorder.write()
    answer = base_updates.art_stage_progress(core)
    assert base_updates.art_stage_progress(core, "stream")["token"] == "stream"
    (worker,) = answer.pop("workers")
    assert answer == {
        "token": "stream",
        "version": 1,
        "total_bytes": 4 * 8 * 2 + 3 * 4,
        "total_tensors": 2,
    }
    assert (worker["rank"], worker["bytes"], worker["tensors"]) == (0, 64, 1)
    assert 0 <= worker["idle_s"] < 60
    assert base_updates.art_stage_progress(core, "another") is None
