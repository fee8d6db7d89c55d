"""`POST /art/v1/weights/update`: a full-weight update's request, defined once.

The body is the LoRA update's (`art_protocol.updates`) without `slot`: `path` (a directory of
safetensors in the served model's Hugging Face names, `model.safetensors` or shards with
`model.safetensors.index.json`), `version` (the new base version, greater than the current
one; the weights as loaded are version 0), and optionally `operation_id` (a retry returns the
first response), `expected_version` (compare-and-swap on the current base version) and
`digest` (`art_protocol.weights_digest` of the weights, which the server checks against the
files it read). The response is an `UpdateResponse` whose `slot` is `BASE_SLOT`.

Instead of `path`, a body may carry `transfer`: the plan of a stream the trainer sends over a
weight-transfer group (`art_protocol.weight_transfer`); then `digest`, when given, is checked
against what the workers received.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from art_protocol.updates import UpdateRequest, UpdateRequestError
from art_protocol.weight_transfer import TransferPlan

ROUTE = "/art/v1/weights/update"
#: The name the base weights go by where a slot name stands (responses, the slot registry).
#: A LoRA module of that name is served but refused for updates.
BASE_SLOT = "<base>"


def slot_named(slot: str) -> str:
    """How messages name a slot: "slot 'x'", or "the base weights" for `BASE_SLOT`."""
    return "the base weights" if slot == BASE_SLOT else f"slot {slot!r}"


_FIELDS = '{"path", "version"[, "operation_id", "expected_version", "digest"]}'
_TRANSFER_FIELDS = '{"transfer", "version"[, "operation_id", "expected_version", "digest"]}'


def weights_update(
    path: str,
    version: int,
    operation_id: str | None = None,
    expected_version: int | None = None,
    digest: str | None = None,
) -> UpdateRequest:
    """A full-weight update request (field rules as for a LoRA update)."""
    return UpdateRequest(BASE_SLOT, path, version, operation_id, expected_version, digest)


def parse_weights_update(body: Any) -> UpdateRequest:
    """The request in a decoded JSON body, or `UpdateRequestError` naming the bad field."""
    if not isinstance(body, Mapping):
        raise UpdateRequestError(f"body must be a JSON object {_FIELDS}")
    if "slot" in body:
        raise UpdateRequestError(
            f"'slot' must not be given: a full-weight update changes the base weights {_FIELDS}"
        )
    if "transfer" in body:
        raise UpdateRequestError("a streamed update is read with parse_transfer_update")
    return UpdateRequest.from_json({**body, "slot": BASE_SLOT})


def is_transfer(body: Any) -> bool:
    """Whether a decoded body asks for a streamed update (`transfer`) rather than files."""
    return isinstance(body, Mapping) and "transfer" in body


def parse_transfer_update(body: Any) -> tuple[UpdateRequest, TransferPlan]:
    """(the request, with `path` None, and the stream's plan) of a streamed update's body, or
    `UpdateRequestError` naming the bad field."""
    if not isinstance(body, Mapping):
        raise UpdateRequestError(f"body must be a JSON object {_TRANSFER_FIELDS}")
    for field in ("slot", "path"):
        if field in body:
            raise UpdateRequestError(
                f"{field!r} must not be given with 'transfer': the weights come in the stream "
                f"{_TRANSFER_FIELDS}"
            )
    request = UpdateRequest(
        BASE_SLOT,
        None,
        body.get("version"),
        body.get("operation_id"),
        body.get("expected_version"),
        body.get("digest"),
    )
    return request, TransferPlan.from_json(body["transfer"])


def body_of(request: UpdateRequest) -> dict[str, Any]:
    """The JSON body to send for a full-weight update (`to_json` without `slot`)."""
    body = request.to_json()
    del body["slot"]
    return body
