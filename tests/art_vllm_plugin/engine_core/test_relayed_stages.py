"""An engine on another host stages from bytes sent in the call (`relayed_stages`).

A stand-in engine (`support.stand_in_engine`) and a staging directory per test
(`ART_STAGING_DIR`, as the engine's host sets it); served for real by test_two_hosts.py.
"""

from __future__ import annotations

import pytest
from support.stand_in_engine import stand_in_engine

from art_vllm_plugin import staging
from art_vllm_plugin.engine_core import abandoned_updates, relayed_stages
from art_vllm_plugin.engine_core.state import engine_state

pytestmark = pytest.mark.serve

FILES = {"adapter_config.json": b"{}", "adapter_model.safetensors": b"w" * 1000}


@pytest.fixture
def host_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(staging.ENV_DIR, str(tmp_path))
    return tmp_path


def stage(core, token="t"):
    return relayed_stages.art_stage_relayed(core, token, 1, "policy", FILES, 2, "xxh3:d", 1)


def test_the_bytes_are_written_on_this_host_and_staged_from_there(host_dir):
    core, sent = stand_in_engine(has_requests=False)
    res = stage(core)
    assert res["ok"] and res["ranks"] == [0]
    (stage_dir,) = host_dir.iterdir()
    assert {p.name: p.read_bytes() for p in stage_dir.iterdir() if p.is_file()} == FILES
    markers = staging.marker_dir(stage_dir, 1)
    ((method, (rides,)),) = sent
    assert method == "art_run_rides"
    assert rides == [("stage", "t", (1, "policy", str(stage_dir), str(markers)))]
    assert engine_state(core).relayed_total == 1
    staging.mark(markers, 0, True)
    assert relayed_stages.art_stage_markers(core, "t", [0]) == ([0], {})
    assert relayed_stages.art_drop_relayed(core, "t")
    assert list(host_dir.iterdir()) == []


def test_a_host_without_room_refuses_with_507_and_keeps_nothing(host_dir, monkeypatch):
    core, sent = stand_in_engine(has_requests=False)
    monkeypatch.setattr(staging, "free_bytes", lambda root: 100)
    res = stage(core)
    assert not res["ok"] and res["kind"] == "staging" and res["status"] == 507
    assert "on this engine's host" in res["error"]
    assert list(host_dir.iterdir()) == [] and sent == []


def test_an_abort_removes_the_relayed_stage(host_dir):
    core, _ = stand_in_engine(has_requests=False)
    stage(core)
    abandoned_updates.abort(core, "t")
    assert list(host_dir.iterdir()) == [] and not engine_state(core).relayed


def test_markers_of_an_unknown_stage_read_as_failed(host_dir):
    core, _ = stand_in_engine(has_requests=False)
    ready, failed = relayed_stages.art_stage_markers(core, "nope", [0, 1])
    assert ready == [] and set(failed) == {0, 1}


def test_a_stage_this_engine_cannot_see_is_refused_at_once(tmp_path):
    """An API server whose staging directory the engine does not share (separate /dev/shm in
    two containers) gets a refusal naming the flag, not a five-minute wait for markers."""
    from art_vllm_plugin.engine_core import slot_updates

    core, sent = stand_in_engine(has_requests=False)
    elsewhere = tmp_path / "only-on-the-api-servers-host"
    res = slot_updates.art_stage_lora_update(
        core, "t", 1, "policy", str(elsewhere), 2, str(elsewhere / "markers-engine0"), "d"
    )
    assert not res["ok"] and res["kind"] == "staging" and "--art-staging-dir" in res["error"]
    assert sent == [] and not engine_state(core).updates.staged
