"""The streamed LoRA update's body (`art_protocol.adapter_stream`): one definition for the
trainer's client and the server, and the config bytes the server writes (part of the digest)."""

from __future__ import annotations

import json

import pytest

from art_protocol.adapter_stream import (
    adapter_stream_body,
    config_bytes,
    is_adapter_stream,
    parse_adapter_stream,
)
from art_protocol.updates import UpdateRequest, UpdateRequestError
from art_protocol.weight_transfer import TransferPlan

PLAN = TransferPlan.of("r1", [("base_model.model.x.lora_A.weight", "bfloat16", (8, 64))])
CONFIG = {"r": 8, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA"}


def test_a_body_round_trips():
    req = UpdateRequest("policy", None, 4, operation_id="op", expected_version=3)
    body = adapter_stream_body(req, PLAN, CONFIG)
    assert is_adapter_stream(body) and "path" not in body
    assert parse_adapter_stream(json.loads(json.dumps(body))) == (req, PLAN, CONFIG)


def test_a_path_body_is_not_a_stream():
    assert not is_adapter_stream({"slot": "policy", "path": "/a", "version": 1})


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda b: b.update(path="/a"), "'path' must not be given"),
        (lambda b: b.pop("adapter_config"), "'adapter_config'"),
        (lambda b: b.update(adapter_config=["r"]), "'adapter_config'"),
        (lambda b: b.update(version=-1), "'version'"),
        (lambda b: b.pop("slot"), "'slot'"),
        (lambda b: b["transfer"].update(names=[]), "'transfer"),
    ],
)
def test_bad_bodies_name_the_field(edit, says):
    body = adapter_stream_body(UpdateRequest("policy", None, 1), PLAN, CONFIG)
    edit(body)
    with pytest.raises(UpdateRequestError, match=says):
        parse_adapter_stream(body)


def test_a_request_with_a_path_is_refused_before_sending():
    with pytest.raises(UpdateRequestError, match="no 'path'"):
        adapter_stream_body(UpdateRequest("policy", "/a", 1), PLAN, CONFIG)


def test_config_bytes_do_not_depend_on_key_order():
    swapped = dict(reversed(list(CONFIG.items())))
    assert config_bytes(swapped) == config_bytes(CONFIG)
    assert json.loads(config_bytes(CONFIG)) == CONFIG
