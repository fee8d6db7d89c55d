"""`decide`: every rule and bound, on hand-built windows."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from support.autotune_inputs import SHAPES, config, settings, window

from art_protocol.autotune import GroupShape, SettingsError, decide, packed_rows
from art_protocol.autotune.config import KNOBS

UNDERFED = dict(wait_fraction=0.5)


def test_warm_up_holds_every_knob_and_says_so():
    d = decide(window(steps_since_start=1, **UNDERFED), settings(), config(warmup_steps=4))
    assert d.settings == d.previous == settings()
    assert all("warm-up: 1 of 4 steps" in d.reasons[k] for k in KNOBS)


def test_underfed_with_headroom_adds_workers_by_a_bounded_step():
    d = decide(window(max_policy_age=1.0, **UNDERFED), settings(rollout_workers=8), config())
    assert d.settings.rollout_workers == 12  # +ceil(0.5 * 8)
    assert "underfed" in d.reasons["rollout_workers"] and "add" in d.reasons["rollout_workers"]


def test_repeated_underfed_windows_stop_at_the_absolute_worker_cap():
    cfg, s = config(max_rollout_workers=20), settings(rollout_workers=8)
    seen = []
    for _ in range(10):
        s = decide(window(max_policy_age=0.0, **UNDERFED), s, cfg).settings
        seen.append(s.rollout_workers)
    assert seen[:3] == [12, 18, 20] and set(seen[2:]) == {20}


def test_added_workers_keep_the_predicted_policy_age_within_the_limit():
    # max age 3 of limit 4 with 9 workers: at most floor(9 * 4 / 3) = 12 workers
    d = decide(window(max_policy_age=3.0, **UNDERFED), settings(rollout_workers=9), config())
    assert d.settings.rollout_workers == 12
    d = decide(window(max_policy_age=4.0, **UNDERFED), settings(rollout_workers=9), config())
    assert d.settings.rollout_workers == 9
    assert "predicted max policy age" in d.reasons["rollout_workers"]


@pytest.mark.parametrize(
    ("full", "words"),
    [
        (dict(running_fraction=0.9), "running 90% of max_num_seqs"),
        (dict(kv_cache_usage=0.95), "KV cache 95% used"),
        (dict(waiting_for_capacity=3.0), "3.0 requests waiting for capacity"),
        (dict(preemptions=2), "2 preemptions"),
    ],
)
def test_underfed_but_server_full_holds_workers(full, words):
    d = decide(window(**UNDERFED, **full), settings(), config())
    assert d.settings.rollout_workers == settings().rollout_workers
    assert "server full" in d.reasons["rollout_workers"] and words in d.reasons["rollout_workers"]


def test_queue_full_holds_workers_even_when_underfed():
    d = decide(window(put_wait_fraction=0.5, **UNDERFED), settings(), config())
    assert d.settings.rollout_workers == settings().rollout_workers
    assert "queue full" in d.reasons["rollout_workers"]


def test_stale_discards_remove_workers_when_the_trainer_is_fed():
    d = decide(window(stale_fraction=0.2, stale_discards=3), settings(rollout_workers=8), config())
    assert d.settings.rollout_workers == 4
    assert "staleness" in d.reasons["rollout_workers"] and "remove" in d.reasons["rollout_workers"]


def test_stale_discards_with_an_underfed_trainer_hold_workers():
    d = decide(window(stale_fraction=0.2, **UNDERFED), settings(rollout_workers=8), config())
    assert d.settings.rollout_workers == 8
    assert "target batch grows" in d.reasons["rollout_workers"]


def test_workers_never_drop_below_the_floor():
    cfg = config(min_rollout_workers=3)
    d = decide(window(stale_fraction=0.5), settings(rollout_workers=4), cfg)
    assert d.settings.rollout_workers == 3


def test_target_comes_from_the_packing_estimate_within_the_spill_bound():
    # identical groups of 1000 + 1900 tokens: every prediction's G is exactly what the
    # project's packer fits in its R rows (G + 1 needs a row more)
    shapes = tuple(GroupShape(1000, (300, 500, 700, 400)) for _ in range(4))
    d = decide(window(shapes=shapes, rows_per_step=2.0), settings(target_groups=4), config())
    assert [p["rows"] for p in d.predictions] == [1, 2, 3, 4, 6]  # R - 1, R, R + 1, 1.5R, 2R, 3R
    for p in d.predictions:
        assert packed_rows(shapes[:1] * p["groups"], 8192) <= p["rows"]
        assert packed_rows(shapes[:1] * (p["groups"] + 1), 8192) > p["rows"]
        assert p["spill"] == 0.0
    best = max(d.predictions, key=lambda p: p["value"])
    assert d.settings.target_groups == min(best["groups"], 4 + 2)  # bounded: +ceil(0.5 * 4)
    assert d.settings.max_batch_groups == d.settings.target_groups
    assert d.settings.min_batch_groups == math.ceil(d.settings.target_groups / 2)
    assert f"{best['groups']} groups fit {best['rows']} rows" in d.reasons["target_groups"]


def test_target_moves_by_a_bounded_step():
    # tiny groups: hundreds fit, but the target may move by at most ceil(0.5 * 4) = 2
    shapes = tuple(GroupShape(10, (5, 5)) for _ in range(4))
    d = decide(
        window(shapes=shapes, tokens_per_group=10.0),
        settings(target_groups=4),
        config(max_batch_ceiling=256),
    )
    assert d.settings.target_groups == 6


def test_target_holds_without_shapes():
    d = decide(window(shapes=()), settings(), config())
    assert d.settings.target_groups == settings().target_groups
    assert "no trained groups" in d.reasons["target_groups"]


def test_queue_capacity_follows_the_policy_age_limit():
    # rollouts span 20 / 10 = 2 steps; limit 6 leaves 6 - 1 - 2 = 3 steps of queueing
    shapes = tuple(GroupShape(3000, (1000,)) for _ in range(4))  # 1 group per 8192-token row
    d = decide(
        window(shapes=shapes, rows_per_step=2.0, tokens_per_group=1000.0),
        settings(target_groups=2, min_batch_groups=1, queue_capacity=6),
        config(policy_age_limit=6),
    )
    assert d.settings.queue_capacity == d.settings.target_groups * 3
    assert "policy-age bound" in d.reasons["queue_capacity"]


def test_every_decision_records_inputs_and_a_reason_per_knob():
    d = decide(window(**UNDERFED), settings(), config())
    assert set(d.reasons) == set(KNOBS) and all(d.reasons.values())
    assert d.inputs["wait_fraction"] == 0.5 and d.inputs["shape_count"] == len(SHAPES)
    assert d.as_dict()["settings"] == d.settings.as_dict()
    assert d.summary().startswith("autotune step 12:")


def test_same_inputs_same_decision():
    a = decide(window(**UNDERFED), settings(), config(seed=7))
    b = decide(window(**UNDERFED), settings(), config(seed=7))
    assert a.settings == b.settings and a.predictions == b.predictions


def test_settings_outside_the_bounds_are_refused_naming_the_knob():
    with pytest.raises(SettingsError, match=r"rollout_workers=41 .*\[1, 40\] \(the absolute"):
        decide(window(), settings(rollout_workers=41), config())
    with pytest.raises(SettingsError, match="min_batch_groups <= target_groups"):
        decide(window(), replace(settings(), target_groups=1, min_batch_groups=2), config())
