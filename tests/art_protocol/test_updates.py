"""The update request and response: one definition that the server's parser and every client
use, so a client cannot build a body the server would refuse for a field rule."""

from __future__ import annotations

import pytest

from art_protocol.updates import (
    MAX_OPERATION_ID,
    UpdateRequest,
    UpdateRequestError,
    UpdateResponse,
)

DIGEST = "xxh3-128:" + "0123456789abcdef" * 2


def test_round_trip_keeps_every_field_and_omits_unset_ones():
    full = UpdateRequest("policy", "/a/v3", 3, "op-1", 2, DIGEST)
    assert UpdateRequest.from_json(full.to_json()) == full
    assert UpdateRequest("policy", "/a/v3", 3).to_json() == {
        "slot": "policy",
        "path": "/a/v3",
        "version": 3,
    }


@pytest.mark.parametrize(
    "body, field",
    [
        ({"path": "/a", "version": 1}, "'slot'"),
        ({"slot": "", "path": "/a", "version": 1}, "'slot'"),
        ({"slot": "p", "version": 1}, "'path'"),
        ({"slot": "p", "path": "/a", "version": -1}, "'version'"),
        ({"slot": "p", "path": "/a", "version": True}, "'version'"),
        ({"slot": "p", "path": "/a", "version": "1"}, "'version'"),
        ({"slot": "p", "path": "/a", "version": 1, "operation_id": ""}, "'operation_id'"),
        (
            {"slot": "p", "path": "/a", "version": 1, "operation_id": "x" * (MAX_OPERATION_ID + 1)},
            "'operation_id'",
        ),
        ({"slot": "p", "path": "/a", "version": 1, "expected_version": -2}, "'expected_version'"),
        ({"slot": "p", "path": "/a", "version": 1, "digest": "md5:00"}, "'digest'"),
    ],
)
def test_a_bad_field_is_named(body, field):
    with pytest.raises(UpdateRequestError, match=field):
        UpdateRequest.from_json(body)


def test_a_client_cannot_build_what_the_parser_refuses():
    with pytest.raises(UpdateRequestError, match="'version'"):
        UpdateRequest("policy", "/a", -1)
    with pytest.raises(ValueError):  # UpdateRequestError is a ValueError for callers
        UpdateRequest("policy", "/a", 1, digest="nope")


def test_a_body_that_is_not_an_object_is_refused():
    with pytest.raises(UpdateRequestError, match="JSON object"):
        UpdateRequest.from_json(["policy", "/a", 1])


def test_unknown_fields_are_ignored():
    body = {"slot": "p", "path": "/a", "version": 1, "future_field": {"x": 1}}
    assert UpdateRequest.from_json(body) == UpdateRequest("p", "/a", 1)


def test_fingerprint_tells_bodies_apart_but_not_operation_ids():
    a = UpdateRequest("p", "/a", 1, "op-1")
    assert a.fingerprint() == UpdateRequest("p", "/a", 1, "op-2").fingerprint()
    assert a.fingerprint() != UpdateRequest("p", "/b", 1, "op-1").fingerprint()
    assert a.fingerprint() != UpdateRequest("p", "/a", 1, "op-1", digest=DIGEST).fingerprint()


def test_response_reads_back_typed_and_ignores_new_fields():
    body = {
        "slot": "p",
        "version": 2,
        "previous_version": 1,
        "digest": DIGEST,
        "step": 40,
        "operation_id": "op",
        "receipts": [{"engine": 0, "step": 40, "version": 2, "digest": DIGEST, "workers": [0]}],
        "elapsed_ms": 3.5,
        "replayed": True,
        "added_later": 1,
    }
    response = UpdateResponse.from_json(body)
    assert response.replayed and response.receipts[0]["workers"] == [0]
    out = response.to_json()
    assert "added_later" not in out and out["replayed"] is True
    assert "replayed" not in UpdateResponse.from_json({**body, "replayed": False}).to_json()
