"""Policy-age helpers against hand-computed values and their edge cases."""

import math

import pytest

from art_protocol.policy_age import (
    FutureVersionError,
    batch_factor,
    freshness,
    policy_age,
    throughput_score,
)


def span(start, end, version, slot="policy"):
    return {"start": start, "end": end, "slot": slot, "version": version}


def test_all_tokens_current():
    spans = [span(0, 10, 5)]
    assert policy_age(spans, 5) == 0.0
    assert freshness(spans, 5) == 1.0


def test_no_tokens():
    assert policy_age({"policy_spans": []}, 3) == 0.0
    assert freshness({"policy_spans": []}, 3) == 1.0


def test_token_weighted_age_and_freshness_by_hand():
    spans = [span(0, 30, 2), span(30, 40, 4)]  # at current 4: 30 tokens age 2, 10 tokens age 0
    assert policy_age(spans, 4) == pytest.approx((30 * 2 + 10 * 0) / 40)
    expected = 40 / (30 * math.exp(2 / 8) + 10 * math.exp(0))
    assert freshness(spans, 4) == pytest.approx(expected)
    assert freshness(spans, 4, tau=2) == pytest.approx(40 / (30 * math.e + 10))


def test_one_very_old_tail_dominates_through_the_exponential():
    spans = [span(0, 99, 100), span(99, 100, 20)]  # one token 80 versions old
    assert policy_age(spans, 100) == pytest.approx(0.8)
    assert freshness(spans, 100) == pytest.approx(100 / (99 + math.exp(10)))
    assert freshness(spans, 100) < 0.01


def test_future_version_is_an_error():
    with pytest.raises(FutureVersionError, match="newer than the trainer's 3"):
        freshness([span(0, 5, 4)], 3)
    with pytest.raises(FutureVersionError):
        policy_age([span(0, 5, 4)], 3)


def test_bad_tau_is_an_error():
    with pytest.raises(ValueError, match="tau"):
        freshness([span(0, 1, 0)], 0, tau=0)


def test_batch_factor_and_score_by_hand():
    assert batch_factor(8, 16) == 1.0
    bf = batch_factor(8, 16, ref_groups=16, ref_rollouts_per_group=8)
    assert bf == pytest.approx((16 + 300 / 8) / (8 + 300 / 16))
    assert throughput_score(1000.0, 0.5, 8, 16, 16, 8) == pytest.approx(1000 * 0.5 * bf)
    assert throughput_score(1000.0, 0.5, 8, 16) == 500.0
    with pytest.raises(ValueError):
        batch_factor(0, 16, 16, 8)
