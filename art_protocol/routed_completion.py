"""The `application/vnd.art.routes` body: a JSON completion and its route bundle in one buffer.

Why one binary body: the routes of a completion are most of its bytes (a 2k-token choice of a
48-layer top-8 model holds 786 k expert ids). vLLM puts them in the JSON as base64 of `.npy`
bytes per choice (a third larger, one base64 pass each way, a JSON parse over all of it). Here
the JSON stays small (text, ids, spans; never route arrays) and the routes follow as one
`ARTR` route bundle (`docs/formats.md`), so the client decodes them into numpy views of the
received buffer without a copy.

Layout (little-endian; `docs/formats.md` "Routed completion"):

    0   4  magic  b"ARTC"
    4   2  u16    version (1)
    6   2  u16    flags (0)
    8   8  u64    json_length
    16  json_length  UTF-8 JSON of the completion
    ..  zero padding to a multiple of 8
    bundle_offset .. end: the ARTR route bundle, choice i = trajectory i

The JSON repeats `art_routes: {format, version, offset, length}` so a client can check it.
This module only needs numpy and the standard library (the client imports it).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

MEDIA_TYPE = "application/vnd.art.routes"
MAGIC = b"ARTC"
VERSION = 1
_HEADER = struct.Struct("<4sHHQ")
HEADER_SIZE = _HEADER.size  # 16
ALIGN = 8


class RoutedBodyError(ValueError):
    """A routed-completion body is malformed; the message says how."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def bundle_offset(json_length: int) -> int:
    return _aligned(HEADER_SIZE + json_length)


def encode_head(completion: dict[str, Any], bundle_length: int) -> bytes:
    """Header + JSON + zero padding: everything before the bundle. `completion` is copied and
    gains `art_routes` (format, version, offset, length). The server sends this and the bundle
    as two writes, so the bundle is never copied into a body buffer."""
    # The offset depends on the JSON length, which depends on the offset's digits: iterate
    # until stable (at most twice in practice).
    meta = {"format": "art-route-bundle", "version": 1, "offset": 0, "length": bundle_length}
    completion = dict(completion, art_routes=meta)
    text = json.dumps(completion, separators=(",", ":")).encode()
    while meta["offset"] != bundle_offset(len(text)):
        meta["offset"] = bundle_offset(len(text))
        text = json.dumps(completion, separators=(",", ":")).encode()
    head = bytearray(meta["offset"])
    _HEADER.pack_into(head, 0, MAGIC, VERSION, 0, len(text))
    head[HEADER_SIZE : HEADER_SIZE + len(text)] = text
    return bytes(head)


def encode_body(completion: dict[str, Any], bundle: bytes | bytearray) -> bytes:
    """The whole body in one buffer (tests, benchmarks; the server writes head and bundle)."""
    return encode_head(completion, len(bundle)) + bytes(bundle)


@dataclass(frozen=True)
class SplitBody:
    completion: dict[str, Any]
    bundle: memoryview  # a view of the received buffer (no copy)


def split_body(data: bytes | bytearray | memoryview) -> SplitBody:
    """Parse the header and JSON; return the JSON and a view of the bundle bytes.

    Raises:
        RoutedBodyError: wrong magic/version/flags, truncated body, or a JSON `art_routes`
            that disagrees with where the bundle really is.
    """
    view = memoryview(data).cast("B")
    if view.nbytes < HEADER_SIZE:
        raise RoutedBodyError(f"truncated routed body: {view.nbytes} bytes < {HEADER_SIZE}")
    magic, version, flags, json_length = _HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise RoutedBodyError(f"not a routed completion: magic {bytes(magic)!r}, want {MAGIC!r}")
    if version != VERSION:
        raise RoutedBodyError(f"routed body version {version} unknown; this reader knows 1")
    if flags != 0:
        raise RoutedBodyError(f"routed body flags must be 0, got {flags}")
    start = bundle_offset(json_length)
    if start > view.nbytes:
        raise RoutedBodyError(
            f"routed body of {view.nbytes} bytes cannot hold {json_length} bytes of JSON"
        )
    try:
        completion = json.loads(bytes(view[HEADER_SIZE : HEADER_SIZE + json_length]))
    except ValueError as exc:
        raise RoutedBodyError(f"routed body JSON does not parse: {exc}") from exc
    meta = completion.get("art_routes") if isinstance(completion, dict) else None
    if not isinstance(meta, dict) or meta.get("version") != 1:
        raise RoutedBodyError(f"routed body JSON lacks art_routes version 1: {meta!r}")
    if meta.get("offset") != start or meta.get("length") != view.nbytes - start:
        raise RoutedBodyError(
            f"art_routes {meta} disagrees with the body (bundle at {start}, "
            f"{view.nbytes - start} bytes)"
        )
    return SplitBody(completion=completion, bundle=view[start:])
