"""The full-weight update request (`art_protocol.weight_updates`): the LoRA update's field
rules without a slot, one definition for client and server."""

from __future__ import annotations

import pytest

from art_protocol.updates import UpdateRequestError
from art_protocol.weight_updates import (
    BASE_SLOT,
    body_of,
    parse_weights_update,
    slot_named,
    weights_update,
)


def test_a_body_round_trips_without_a_slot():
    req = weights_update("/ckpt/v3", 3, operation_id="op", expected_version=2)
    body = body_of(req)
    assert body == {"path": "/ckpt/v3", "version": 3, "operation_id": "op", "expected_version": 2}
    assert parse_weights_update(body) == req and req.slot == BASE_SLOT


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ([], "JSON object"),
        ({"version": 1}, "'path'"),
        ({"path": "/p", "version": -1}, "'version'"),
        ({"path": "/p", "version": 1, "digest": "md5:0"}, "'digest'"),
        ({"slot": "policy", "path": "/p", "version": 1}, "'slot' must not be given"),
    ],
)
def test_bad_bodies_name_the_field(body, says):
    with pytest.raises(UpdateRequestError, match=says):
        parse_weights_update(body)


def test_messages_name_the_base_weights():
    assert slot_named(BASE_SLOT) == "the base weights" and slot_named("p") == "slot 'p'"
