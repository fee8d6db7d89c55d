"""Base-weight versions in provenance: the engine label, the spans built from it, the
trainer's check and the policy age (pure functions, no server)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from art_protocol.policy_age import FutureVersionError, freshness, policy_age
from art_protocol.provenance import (
    base_version,
    decode_label,
    decode_versions,
    encode_versions,
    policy_spans,
    slot_version,
)
from art_protocol.spans import SpanError, validate_spans


def _wv(label: str, start: int, end: int):
    """A vLLM `WeightVersionSpan` (version, start, end)."""
    return SimpleNamespace(version=label, start=start, end=end)


def test_lora_only_labels_are_unchanged_and_the_base_rides_behind_them():
    assert encode_versions({2: 7, 1: 5}) == "art1|1=5,2=7"  # what it always was
    label = encode_versions({2: 7, 1: 5}, base_version=3)
    assert label == "art1|1=5,2=7|b=3"
    assert decode_label(label) == ({1: 5, 2: 7}, 3)
    assert decode_versions(label) == {1: 5, 2: 7} and base_version(label) == 3
    assert slot_version(label, 2) == 7 and slot_version(label, None) == 0
    assert decode_label(encode_versions({}, 4)) == ({}, 4)  # a model served without LoRA
    assert decode_label("default") == ({}, 0)  # vLLM's own label: the loaded weights


def test_a_span_ends_where_the_base_version_changes_even_if_the_slot_does_not():
    labels = [
        _wv(encode_versions({1: 2}), 0, 4),
        _wv(encode_versions({1: 2, 9: 1}), 4, 6),  # another slot's update: same span
        _wv(encode_versions({1: 2, 9: 1}, 1), 6, 9),  # the base changed under slot 1
        _wv(encode_versions({1: 3}, 1), 9, 10),
    ]
    assert policy_spans(labels, 10, "policy", 1) == [
        {"start": 0, "end": 6, "slot": "policy", "version": 2},
        {"start": 6, "end": 9, "slot": "policy", "version": 2, "base_version": 1},
        {"start": 9, "end": 10, "slot": "policy", "version": 3, "base_version": 1},
    ]


def test_a_base_model_request_gets_spans_with_base_versions():
    labels = [_wv("default", 0, 3), _wv(encode_versions({}, 1), 3, 5)]
    assert policy_spans(labels, 5, None, None) == [
        {"start": 0, "end": 3, "slot": None, "version": 0},
        {"start": 3, "end": 5, "slot": None, "version": 0, "base_version": 1},
    ]


def test_validate_spans_checks_the_base_version_against_the_trainers():
    spans = [
        {"start": 0, "end": 3, "slot": None, "version": 0},
        {"start": 3, "end": 5, "slot": None, "version": 0, "base_version": 2},
    ]
    choice = {"policy_spans": spans}
    assert validate_spans(choice, 5, 0, latest_base_version=2) == spans
    with pytest.raises(SpanError, match="base_version 2, newer than the latest published base"):
        validate_spans(choice, 5, 0, latest_base_version=1)
    with pytest.raises(SpanError, match="pass latest_base_version"):
        validate_spans(choice, 5, 0)  # a base-updated span is never taken unchecked
    # LoRA-only spans (no base_version) need no base number, as before
    assert validate_spans({"policy_spans": spans[:1]}, 3, 0)
    bad = {"policy_spans": [{"start": 0, "end": 1, "slot": None, "version": 0,
                             "base_version": "1"}]}  # fmt: skip
    with pytest.raises(SpanError, match="base_version must be an integer"):
        validate_spans(bad, 1, 0, latest_base_version=3)


def test_policy_age_counts_updates_of_either_kind_behind():
    spans = [
        {"start": 0, "end": 2, "slot": "p", "version": 4},  # base 0
        {"start": 2, "end": 4, "slot": "p", "version": 5, "base_version": 1},
    ]
    # trainer at slot version 5 and base version 2: ages (1 + 2) and (0 + 1)
    assert policy_age(spans, 5, current_base=2) == pytest.approx(2.0)
    assert freshness(spans, 5, current_base=1) < freshness(spans, 5, current_base=1, tau=1e9)
    assert policy_age(spans[:1], 4) == 0.0  # a LoRA-only run: as before
    with pytest.raises(FutureVersionError, match="base_version 1, newer than the trainer's"):
        policy_age(spans, 5)  # the trainer's base is behind the rollout's: an error
