"""`Autotuner`: the strict metrics contract, hold-and-report, warm-up after resume, profiles."""

from __future__ import annotations

import json

import pytest
from support.autotune_inputs import config, record, settings, snapshot

from art_protocol.autotune import (
    Autotuner,
    MetricsContractError,
    ProfileError,
    load_profile,
)
from art_protocol.autotune import profile as profile_mod


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def run_steps(tuner, clock, steps, **record_overrides):
    """One poll per simulated second, a 10 s step each."""
    for step in steps:
        for _ in range(10):
            clock.t += 1.0
            tuner.observe(snapshot(snapshot_time=clock.t))
        tuner.on_step(record(step, **record_overrides))


def test_a_missing_metric_raises_naming_it():
    tuner = Autotuner(config(), settings(), clock=Clock())
    bad = snapshot()
    del bad["num_waiting_for_capacity"]
    with pytest.raises(MetricsContractError, match="'num_waiting_for_capacity'") as info:
        tuner.observe(bad)
    assert info.value.metric == "num_waiting_for_capacity"


def test_an_old_schema_is_refused():
    tuner = Autotuner(config(), settings(), clock=Clock())
    with pytest.raises(MetricsContractError, match="schema_version 1 < 2"):
        tuner.observe(snapshot(schema_version=1))


def test_a_metric_older_than_twice_the_poll_interval_raises_at_the_decision():
    clock = Clock()
    tuner = Autotuner(config(), settings(), clock=clock)
    run_steps(tuner, clock, [1, 2, 3])  # warm-up (2 steps) + the first step of a window
    clock.t += 2.5  # no poll for 2.5 s > 2 x 1 s
    with pytest.raises(
        MetricsContractError,
        match=r"'schema_version' is stale: last received "
        r"2\.5s ago, limit 2\.0s",
    ):
        tuner.on_step(record(4))


def test_a_snapshot_whose_engine_stopped_stepping_with_work_pending_is_stale():
    clock = Clock()
    tuner = Autotuner(config(), settings(), clock=clock)
    run_steps(tuner, clock, [1, 2, 3])
    tuner.observe(snapshot(age_s=5.0, num_running=4))
    with pytest.raises(MetricsContractError, match="snapshot_time is stale") as info:
        tuner.on_step(record(4))
    assert info.value.metric == "snapshot_time"


def test_an_idle_engine_is_not_stale():
    clock = Clock()
    tuner = Autotuner(config(), settings(), clock=clock)
    run_steps(tuner, clock, [1, 2, 3])
    tuner.observe(snapshot(age_s=30.0, idle=True, num_running=0))
    tuner.on_step(record(4))
    assert len(tuner.decisions) == 1


def test_hold_mode_keeps_the_settings_and_reports_the_degraded_window():
    clock = Clock()
    tuner = Autotuner(config(on_bad_metrics="hold"), settings(), clock=clock)
    run_steps(tuner, clock, [1, 2, 3], wait_s=8.0)  # underfed: would add workers
    bad = snapshot()
    del bad["preemptions_total"]
    tuner.observe(bad)
    tuner.on_step(record(4, wait_s=8.0))
    decision = tuner.last_decision
    assert decision.degraded and decision.settings == settings()
    assert "'preemptions_total'" in decision.reasons["rollout_workers"]
    run_steps(tuner, clock, [5, 6], wait_s=8.0)  # healthy again: the next window decides
    assert not tuner.last_decision.degraded
    assert tuner.settings.rollout_workers > settings().rollout_workers


def test_warm_up_counts_from_the_first_step_of_a_resumed_run(tmp_path):
    clock, path = Clock(), tmp_path / "profile.json"
    first = Autotuner(config(), settings(), clock=clock, profile_path=path)
    run_steps(first, clock, range(1, 5), wait_s=8.0)
    assert [d.step for d in first.decisions] == [4]  # steps 1-2 warm up, window 3-4
    resumed = Autotuner.resume(path, config(), clock=clock)
    assert resumed.settings == first.settings
    run_steps(resumed, clock, [100, 101, 102], wait_s=8.0)
    assert resumed.decisions == []  # 100 is this run's first step: 100-101 warm up again
    run_steps(resumed, clock, [103], wait_s=8.0)
    assert [d.step for d in resumed.decisions] == [103]
    assert resumed.run_first_step == 100


def test_profile_is_saved_at_every_decision_and_resumes(tmp_path):
    clock, path = Clock(), tmp_path / "run" / "autotune.json"
    tuner = Autotuner(config(), settings(), clock=clock, profile_path=path)
    run_steps(tuner, clock, range(1, 8), wait_s=8.0)
    payload = json.loads(path.read_text())
    assert payload["schema_version"] == 1 and payload["step"] == tuner.decisions[-1].step
    assert len(payload["decisions"]) == len(tuner.decisions)
    assert payload["decisions"][-1]["reasons"]["rollout_workers"]
    loaded, _ = load_profile(path, config())
    assert loaded == tuner.settings
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind


def test_a_profile_outside_the_current_bounds_is_refused(tmp_path):
    path = tmp_path / "p.json"
    profile_mod.save_profile(path, settings(rollout_workers=30), config(), 9, [])
    with pytest.raises(
        ProfileError,
        match=r"rollout_workers=30 is outside this config's bounds "
        r"\[1, 20\] \(the absolute worker cap\); refusing to resume",
    ):
        Autotuner.resume(path, config(max_rollout_workers=20))


def test_a_profile_of_another_schema_version_is_refused(tmp_path):
    path = tmp_path / "p.json"
    profile_mod.save_profile(path, settings(), config(), 9, [])
    payload = json.loads(path.read_text())
    payload["schema_version"] = 99
    path.write_text(json.dumps(payload))
    with pytest.raises(ProfileError, match="schema_version 99"):
        load_profile(path, config())


def test_a_crash_while_saving_leaves_the_previous_profile(tmp_path, monkeypatch):
    path = tmp_path / "p.json"
    profile_mod.save_profile(path, settings(rollout_workers=5), config(), 3, [])

    def torn(payload, f, **kw):
        f.write('{"schema": "art-autotune-prof')  # half a file, then the crash
        raise OSError("disk full")

    monkeypatch.setattr(profile_mod.json, "dump", torn)
    with pytest.raises(OSError, match="disk full"):
        profile_mod.save_profile(path, settings(rollout_workers=9), config(), 6, [])
    monkeypatch.undo()
    loaded, payload = load_profile(path, config())
    assert loaded.rollout_workers == 5 and payload["step"] == 3


def test_polling_thread_errors_surface_at_the_next_step():
    clock = Clock()
    calls = []

    def fetch():
        calls.append(1)
        return {"schema_version": 2}  # lacks everything else

    tuner = Autotuner(config(poll_interval_s=0.01), settings(), clock=clock, fetch=fetch)
    tuner.start_polling()
    tuner._thread.join(timeout=30)  # the thread ends at its first error
    tuner.stop_polling()
    with pytest.raises(MetricsContractError, match="'snapshot_time'"):
        tuner.on_step(record(1))
    assert calls
