"""A streamed full-weight update's body (`art_protocol.weight_transfer`,
`weight_updates.parse_transfer_update`): the plan round-trips, its layout is checked against a
checkpoint's in safetensors' dtype codes, and every bad field is named."""

from __future__ import annotations

import pytest

from art_protocol.checkpoint_layout import TensorSpec
from art_protocol.updates import UpdateRequestError
from art_protocol.weight_transfer import TransferPlan, ready_key
from art_protocol.weight_updates import BASE_SLOT, is_transfer, parse_transfer_update

PLAN = TransferPlan.of("r-1", [("a.weight", "bfloat16", (4, 3)), ("b.bias", "float32", (3,))])


def test_a_streamed_body_round_trips_and_names_no_path():
    body = {"version": 4, "digest": "xxh3-128:" + "a" * 32, "transfer": PLAN.to_json()}
    assert is_transfer(body) and not is_transfer({"path": "/p", "version": 4})
    request, plan = parse_transfer_update(body)
    assert plan == PLAN
    assert request.slot == BASE_SLOT and request.path is None and request.version == 4
    assert plan.layout() == {
        "a.weight": TensorSpec("BF16", (4, 3)),
        "b.bias": TensorSpec("F32", (3,)),
    }
    assert ready_key("r-1", 2) != ready_key("r-2", 2) != ready_key("r-1", 1)


def _plan(**changes) -> dict:
    return {**PLAN.to_json(), **changes}


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"version": 1, "transfer": []}, "'transfer' must be a JSON object"),
        ({"version": 1, "path": "/p", "transfer": _plan()}, "'path' must not be given"),
        ({"version": 1, "slot": "x", "transfer": _plan()}, "'slot' must not be given"),
        ({"version": -1, "transfer": _plan()}, "'version'"),
        ({"version": 1, "transfer": _plan(round="")}, "'transfer.round'"),
        ({"version": 1, "transfer": _plan(names=[])}, "at least one tensor"),
        ({"version": 1, "transfer": _plan(names=["a.weight"])}, "one entry per tensor"),
        ({"version": 1, "transfer": _plan(names=["a", "a"])}, "more than once"),
        ({"version": 1, "transfer": _plan(dtypes=["float32", "complex7"])}, "'complex7'"),
        ({"version": 1, "transfer": _plan(shapes=[[4, -3], [3]])}, "non-negative integers"),
        ({"version": 1, "transfer": _plan(shapes=None)}, "the lists"),
    ],
)
def test_bad_streamed_bodies_name_the_field(body, says):
    with pytest.raises(UpdateRequestError, match=says):
        parse_transfer_update(body)


def test_a_plan_is_the_same_body_on_every_try_and_another_layout_is_not():
    """An operation id's retry opens a fresh round: the body it is recognised by leaves the
    round out and keeps every name, dtype and shape."""
    tensors = [("a", "bfloat16", (2, 3)), ("b", "float32", (4,))]
    first, retry = TransferPlan.of("r1", tensors), TransferPlan.of("r2", tensors)
    assert first.body_id() == retry.body_id()
    others = [
        [("a", "bfloat16", (3, 2)), ("b", "float32", (4,))],
        [("a", "float16", (2, 3)), ("b", "float32", (4,))],
        [("b", "float32", (4,)), ("a", "bfloat16", (2, 3))],
        [("a", "bfloat16", (2, 3))],
    ]
    assert len({first.body_id(), *(TransferPlan.of("r1", t).body_id() for t in others)}) == 5
