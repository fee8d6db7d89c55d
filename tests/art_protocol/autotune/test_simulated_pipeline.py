"""A short simulated Pipeline RL run (tests/support/pipeline_sim, a test harness, not a GPU
claim): the tuner, started from a deliberately bad fixed setting, beats that setting."""

from __future__ import annotations

from support.pipeline_sim import BAD_SETTINGS, WORKLOADS, run_fixed, run_tuned, tuner_config


def test_the_tuner_beats_a_deliberately_bad_fixed_setting(tmp_path):
    w = WORKLOADS["short_single_turn"]
    fixed = run_fixed(w, BAD_SETTINGS, seed=0, steps=24)
    tuned = run_tuned(
        w, BAD_SETTINGS, 0, tuner_config(w), steps=24, profile_path=tmp_path / "profile.json"
    )
    assert tuned.score() > 1.5 * fixed.score()
    # it got there by moving the knobs the rules name, within their bounds
    final = tuned.decisions[-1].settings
    assert final.rollout_workers > BAD_SETTINGS.rollout_workers
    assert final.target_groups > BAD_SETTINGS.target_groups
    assert final.rollout_workers <= tuner_config(w).max_rollout_workers
    assert (tmp_path / "profile.json").exists()


def test_the_simulation_is_deterministic_per_seed():
    w = WORKLOADS["single_turn_tool"]
    a, b = run_fixed(w, BAD_SETTINGS, 1, steps=12), run_fixed(w, BAD_SETTINGS, 1, steps=12)
    assert a.score() == b.score() and [s.t_end for s in a.steps] == [s.t_end for s in b.steps]
