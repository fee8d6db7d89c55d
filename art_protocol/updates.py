"""`POST /art/v1/lora/update`: the request and the response, defined once.

The server parses a body with `UpdateRequest.from_json`; every client (the HTTP client, the
fleet, the trainer's `post_update`) builds one with `UpdateRequest(...)` and sends
`to_json()`. A field rule therefore cannot drift between the side that writes a body and the
side that reads it: a client that builds a bad request fails before it sends anything, with the
same message the server would answer with a 400.

A push (`art_protocol.push`: the adapter's files travel in the body, `multipart/form-data`)
carries the same request without `path`: `UpdateRequest(slot, None, version, ...)`, read by the
server with `from_push_json`.

The response is a plain JSON object (`UpdateResponse.from_json` reads it back typed); its
`receipts` say which engine committed which version at which step.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from art_protocol.digest import DigestFormatError, check_format

ROUTE = "/art/v1/lora/update"
#: Longest accepted `operation_id` (EngineCore keeps the last 512 per slot).
MAX_OPERATION_ID = 200
_FIELDS = '{"slot", "path", "version"[, "operation_id", "expected_version", "digest"]}'
_PUSH_FIELDS = '{"slot", "version"[, "operation_id", "expected_version", "digest"]}'


class UpdateRequestError(ValueError):
    """An update body that breaks a field rule; the message names the field."""


def _is_version(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


@dataclass(frozen=True)
class UpdateRequest:
    """Publish `path` as `version` of `slot` (`path` None: a push, the files are in the body).

    `operation_id` makes a retry idempotent (the server answers a repeated id with the first
    response, `replayed: true`); `expected_version` is a compare-and-swap on the slot's
    current version; `digest` (`xxh3-128:...`, see `art_protocol.digest`) must match the
    bytes the server reads.
    """

    slot: str
    path: str | None
    version: int
    operation_id: str | None = None
    expected_version: int | None = None
    digest: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.slot, str) or not self.slot:
            raise UpdateRequestError(f"'slot' must be a non-empty string, got {self.slot!r}")
        if self.path is not None and (not isinstance(self.path, str) or not self.path):
            raise UpdateRequestError(f"'path' must be a non-empty string, got {self.path!r}")
        if not _is_version(self.version):
            raise UpdateRequestError(
                f"'version' must be a non-negative integer, got {self.version!r}"
            )
        op = self.operation_id
        if op is not None and (not isinstance(op, str) or not 0 < len(op) <= MAX_OPERATION_ID):
            raise UpdateRequestError(
                f"'operation_id' must be a string of 1..{MAX_OPERATION_ID} characters, got {op!r}"
            )
        if self.expected_version is not None and not _is_version(self.expected_version):
            raise UpdateRequestError(
                f"'expected_version' must be a non-negative integer, got {self.expected_version!r}"
            )
        if self.digest is not None:
            try:
                check_format(self.digest)
            except DigestFormatError as exc:
                raise UpdateRequestError(f"'digest': {exc}") from exc

    @classmethod
    def from_json(cls, body: Any) -> UpdateRequest:
        """The request in a decoded JSON body, or `UpdateRequestError` naming the bad field.
        Unknown fields are ignored (a newer client may send more)."""
        if not isinstance(body, Mapping):
            raise UpdateRequestError(f"body must be a JSON object {_FIELDS}")
        if body.get("path") is None:
            raise UpdateRequestError(f"'path' must be a non-empty string, got {None!r}")
        return cls(
            slot=body.get("slot"),
            path=body.get("path"),
            version=body.get("version"),
            operation_id=body.get("operation_id"),
            expected_version=body.get("expected_version"),
            digest=body.get("digest"),
        )

    @classmethod
    def from_push_json(cls, body: Any) -> UpdateRequest:
        """The `request` part of a push, or `UpdateRequestError` naming the bad field. A push
        names no `path`: its adapter is the body's other parts."""
        if not isinstance(body, Mapping):
            raise UpdateRequestError(f"the 'request' part must be a JSON object {_PUSH_FIELDS}")
        if "path" in body:
            raise UpdateRequestError(
                "'path' must not be given in a push: the adapter's files are the other parts "
                f"of the body (the 'request' part is {_PUSH_FIELDS})"
            )
        return cls(
            slot=body.get("slot"),
            path=None,
            version=body.get("version"),
            operation_id=body.get("operation_id"),
            expected_version=body.get("expected_version"),
            digest=body.get("digest"),
        )

    def to_json(self) -> dict[str, Any]:
        """The body to send: the required fields and every optional one that is set (no
        `path` for a push)."""
        body: dict[str, Any] = {"slot": self.slot, "path": self.path, "version": self.version}
        if self.path is None:
            del body["path"]
        for name in ("operation_id", "expected_version", "digest"):
            value = getattr(self, name)
            if value is not None:
                body[name] = value
        return body

    def fingerprint(self, content: str | None = None) -> str:
        """What "the same body" means for an operation id: the path as sent (not resolved),
        or for a push the digest of its bytes (`content`, computed by the server)."""
        source = self.path if self.path is not None else f"push {content}"
        return json.dumps(
            [self.slot, source, self.version, self.expected_version, self.digest],
            separators=(",", ":"),
        )


@dataclass(frozen=True)
class UpdateResponse:
    """The server's answer to an accepted update (HTTP 200)."""

    slot: str
    version: int
    previous_version: int
    digest: str
    step: int
    operation_id: str | None = None
    #: One per engine: `{engine, step, version, digest, workers}`.
    receipts: list[dict[str, Any]] = field(default_factory=list)
    elapsed_ms: float = 0.0
    engine_ms: float = 0.0
    stall_ms: float = 0.0
    resalted_waiting: int = 0
    #: True when the server answered a repeated `operation_id` with the first response.
    replayed: bool = False

    def to_json(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        if not self.replayed:
            del out["replayed"]
        return out

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> UpdateResponse:
        """Typed view of a response body (fields this version does not know are ignored)."""
        known = {k: body[k] for k in cls.__dataclass_fields__ if k in body}
        return cls(**known)
