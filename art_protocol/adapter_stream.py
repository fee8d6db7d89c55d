"""A LoRA slot update whose adapter the trainer streams (`POST /art/v1/lora/update` with
`transfer`): the body, defined once.

Why: a path update needs a file system both sides see; a push sends the files in the HTTP
body. A stream needs neither: the adapter's tensors go over the weight-transfer group the
trainer already keeps with every worker for full weights (`art_gloo`, `art_nixl`:
`art_protocol.weight_transfer`), and only the adapter's config travels in the request.

The body: the update's fields without `path` (`{"slot", "version"[, "operation_id",
"expected_version", "digest"]}`), plus
- `transfer`: the stream's plan (`TransferPlan`: names in PEFT's form, dtypes, shapes);
- `adapter_config`: the adapter's `adapter_config.json` as a JSON object.

What the server then holds is the adapter as files written from what arrived: the config
as `config_bytes` writes it, the tensors as safetensors writes them (names sorted). The
version's `digest` is `art_protocol.digest` of those two files, as for a path or a push of
the same files, so a trainer that wants to name it computes it from the same two files.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from art_protocol.updates import UpdateRequest, UpdateRequestError
from art_protocol.weight_transfer import TransferPlan

#: The body's field holding `adapter_config.json`.
CONFIG_FIELD = "adapter_config"
_FIELDS = (
    '{"slot", "version", "transfer", "adapter_config"[, "operation_id", "expected_version", '
    '"digest"]}'
)


def config_bytes(config: Mapping[str, Any]) -> bytes:
    """`adapter_config.json` as the server writes it from a stream's `adapter_config`."""
    return (json.dumps(dict(config), indent=2, sort_keys=True) + "\n").encode()


def is_adapter_stream(body: Any) -> bool:
    """Whether a decoded LoRA update body asks for a streamed adapter rather than a path."""
    return isinstance(body, Mapping) and "transfer" in body


def parse_adapter_stream(body: Any) -> tuple[UpdateRequest, TransferPlan, dict[str, Any]]:
    """(the request with `path` None, the stream's plan, the adapter's config) of a body, or
    `UpdateRequestError` naming the bad field."""
    if not isinstance(body, Mapping):
        raise UpdateRequestError(f"body must be a JSON object {_FIELDS}")
    if "path" in body:
        raise UpdateRequestError(
            f"'path' must not be given with 'transfer': the adapter comes in the stream {_FIELDS}"
        )
    config = body.get(CONFIG_FIELD)
    if not isinstance(config, Mapping):
        raise UpdateRequestError(
            f"{CONFIG_FIELD!r} must be the adapter's adapter_config.json as a JSON object {_FIELDS}"
        )
    request = UpdateRequest(
        body.get("slot"),
        None,
        body.get("version"),
        body.get("operation_id"),
        body.get("expected_version"),
        body.get("digest"),
    )
    return request, TransferPlan.from_json(body["transfer"]), dict(config)


def adapter_stream_body(
    request: UpdateRequest, plan: TransferPlan, config: Mapping[str, Any]
) -> dict[str, Any]:
    """The JSON body of a streamed LoRA update (`request.path` must be None)."""
    if request.path is not None:
        raise UpdateRequestError("a streamed adapter's request names no 'path'")
    return {**request.to_json(), "transfer": plan.to_json(), CONFIG_FIELD: dict(config)}
