"""Receiving a pushed adapter: `POST /art/v1/lora/update` with `multipart/form-data`.

The body (`art_protocol.push`) holds a `request` part (the update's JSON without `path`) and one
part per adapter file. Why streamed: an adapter may be gigabytes, so its bytes go from the
socket into a fresh staging directory (`art_vllm_plugin.staging`) as they arrive, never held
whole in the API server before they are staged. python-multipart's push parser (the one
starlette uses, without starlette's spooled temporary files) is fed the body in blocks of up to
`FEED_BYTES` on a thread, so the event loop only moves bytes.

Refused before anything is read: a `Content-Length` over `--art-max-adapter-bytes` (plus
`FRAMING_ALLOWANCE` for the request part and the multipart framing) is 413, one the staging
directory has no room for is 507. While streaming: file bytes over the limit are 413, a full
file system is 507, a malformed body or part is 400, a `request` part naming an unknown slot
is 404 (when it comes first). The refusal is answered at once; uvicorn then reads and drops
what the client still sends, so a client that sends its whole body before it reads gets the
answer. Whatever is refused, the staging directory is removed: nothing stays staged.

What arrives is then an update like any other (`UpdateCoordinator.update(req, pushed)`): the
staged files are read once, validated and digested, and published from that same directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from art_protocol.push import FILE_PARTS, REQUEST_PART
from art_protocol.updates import UpdateRequest, UpdateRequestError
from art_vllm_plugin import staging
from art_vllm_plugin.adapters import AdapterFiles
from art_vllm_plugin.api_server.update_coordinator import UpdateError

#: Body bytes handed to the parser per thread hop.
FEED_BYTES = 1 << 20
#: Largest `request` part accepted.
REQUEST_PART_MAX = 64 * 1024
#: What a push's Content-Length may exceed `--art-max-adapter-bytes` by: the request part and
#: the multipart boundaries and part headers.
FRAMING_ALLOWANCE = REQUEST_PART_MAX + 16 * 1024
_EXPECTED = f"a {REQUEST_PART!r} part and one part per adapter file ({', '.join(FILE_PARTS)})"


def is_push(content_type: str | None) -> bool:
    return (content_type or "").split(";", 1)[0].strip().lower() == "multipart/form-data"


@dataclass
class PushedAdapter:
    """A push received whole: its request and the staging directory holding its files."""

    request: UpdateRequest
    stage_dir: Path
    sizes: dict[str, int]

    @property
    def source(self) -> Path:
        """How errors name the pushed adapter (its files are `<source>/<file>`)."""
        return Path(f"<push of {self.request.slot}@{self.request.version}>")

    def read(self) -> AdapterFiles:
        """The staged files' bytes (read once, for validation and the digest)."""
        config, weights = ((self.stage_dir / name).read_bytes() for name in FILE_PARTS)
        return AdapterFiles(self.source, config, weights)

    def discard(self) -> None:
        staging.remove(self.stage_dir)


def _refused(exc: staging.StagingRefused) -> UpdateError:
    return UpdateError(exc.status, f"{exc}; nothing changed")


@dataclass
class _Sink:
    """python-multipart's callbacks: the request part in memory, file parts into the stage.
    Runs on a worker thread (`feed`); an exception raised here ends the parse."""

    config: staging.StagingConfig
    request: UpdateRequest | None = None
    stage_dir: Path | None = None
    sizes: dict[str, int] = field(default_factory=dict)
    ended: bool = False
    _seen: set[str] = field(default_factory=set)
    _name: str | None = None
    _file: BinaryIO | None = None
    _request_bytes: bytearray = field(default_factory=bytearray)
    _header: bytes = b""
    _value: bytes = b""
    _disposition: bytes = b""

    def callbacks(self) -> dict[str, Any]:
        return {
            "on_part_begin": self._part_begin,
            "on_header_field": self._header_field,
            "on_header_value": self._header_value,
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
            "on_end": self._end,
        }

    def feed(self, parser, data: bytes) -> None:
        from python_multipart.exceptions import MultipartParseError

        try:
            parser.write(data)
        except MultipartParseError as exc:
            raise UpdateError(
                400, f"the body is not valid multipart/form-data ({exc}); nothing changed"
            ) from exc

    def _part_begin(self) -> None:
        self._name, self._disposition = None, b""

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        if self._header.lower() == b"content-disposition":
            self._disposition = self._value
        self._header, self._value = b"", b""

    def _headers_finished(self) -> None:
        from python_multipart.multipart import parse_options_header

        _, options = parse_options_header(self._disposition)
        name = options.get(b"name", b"").decode("utf-8", "replace")
        if name != REQUEST_PART and name not in FILE_PARTS:
            raise UpdateError(
                400, f"unexpected part {name!r}: a push has {_EXPECTED}; nothing changed"
            )
        if name in self._seen:
            raise UpdateError(400, f"part {name!r} appears twice; nothing changed")
        self._seen.add(name)
        self._name = name
        if name == REQUEST_PART:
            return
        if self.stage_dir is None:
            label = self.request or UpdateRequest("push", None, 0)
            self.stage_dir = self._staged(
                staging.new_stage_dir, self.config, label.slot, label.version
            )
        self.sizes[name] = 0
        self._file = self._staged(open, self.stage_dir / name, "xb")

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._name == REQUEST_PART:
            self._request_bytes += data[start:end]
            if len(self._request_bytes) > REQUEST_PART_MAX:
                raise UpdateError(
                    400,
                    f"the {REQUEST_PART!r} part is over {REQUEST_PART_MAX} bytes; nothing changed",
                )
            return
        self.sizes[self._name] += end - start
        total = sum(self.sizes.values())
        if total > self.config.max_adapter_bytes:
            raise UpdateError(
                413,
                f"the pushed adapter is over this server's limit of "
                f"{self.config.max_adapter_bytes} bytes (--art-max-adapter-bytes): {total} "
                "bytes received so far; nothing was staged; nothing changed",
            )
        self._staged(self._file.write, memoryview(data)[start:end])

    def _part_end(self) -> None:
        if self._name == REQUEST_PART:
            try:
                body = json.loads(bytes(self._request_bytes))
                self.request = UpdateRequest.from_push_json(body)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise UpdateError(
                    400, f"the {REQUEST_PART!r} part is not valid JSON: {exc}; nothing changed"
                ) from exc
            except UpdateRequestError as exc:
                raise UpdateError(
                    400, f"the {REQUEST_PART!r} part: {exc}; nothing changed"
                ) from exc
        elif self._file is not None:
            self._staged(self._file.close)
            self._file = None

    def _end(self) -> None:
        self.ended = True

    def _staged(self, fn, *args):
        """A file system call for the stage; a failure is 507 (full) or 500, named."""
        try:
            return fn(*args)
        except OSError as exc:
            raise _refused(self.config.refusal_for(exc, "the pushed adapter")) from exc

    def finish(self) -> PushedAdapter:
        if not self.ended:
            raise UpdateError(
                400, "the multipart body ended before its closing boundary; nothing changed"
            )
        if self.request is None:
            raise UpdateError(400, f"the push has no {REQUEST_PART!r} part: a push has {_EXPECTED}")
        missing = [name for name in FILE_PARTS if name not in self.sizes]
        if missing:
            raise UpdateError(
                400,
                f"the push has no {missing[0]!r} part: a push has {_EXPECTED}; nothing changed",
            )
        return PushedAdapter(self.request, self.stage_dir, dict(self.sizes))

    def close(self, keep: bool) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        if not keep and self.stage_dir is not None:
            staging.remove(self.stage_dir)


def _boundary(content_type: str) -> bytes:
    from python_multipart.multipart import parse_options_header

    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise UpdateError(400, "multipart/form-data without a boundary; nothing changed")
    return boundary


def _precheck(headers, config: staging.StagingConfig) -> None:
    """Refuse by the declared length before reading a byte of the body."""
    length = headers.get("content-length")
    if length is None or not length.isdigit():
        return  # chunked: the limit and the space are checked as the bytes arrive
    length = int(length)
    if length > config.max_adapter_bytes + FRAMING_ALLOWANCE:
        raise UpdateError(
            413,
            f"the pushed body is {length} bytes, over this server's limit of "
            f"{config.max_adapter_bytes} bytes for an adapter (--art-max-adapter-bytes) plus "
            f"{FRAMING_ALLOWANCE} for the request part; nothing was staged; nothing changed",
        )
    try:
        config.check_space(length, f"the pushed adapter (Content-Length {length})")
    except staging.StagingRefused as exc:
        raise _refused(exc) from exc


async def receive(request, config: staging.StagingConfig, check_request) -> PushedAdapter:
    """Stream a push into a fresh stage directory; `check_request(req)` may refuse the
    update (raising `UpdateError`) as soon as its `request` part is known."""
    from python_multipart.multipart import MultipartParser

    sink = _Sink(config)
    kept = False
    try:
        _precheck(request.headers, config)
        parser = MultipartParser(_boundary(request.headers["content-type"]), sink.callbacks())
        checked = False
        pending: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            if chunk:
                pending.append(chunk)
                size += len(chunk)
            if size >= FEED_BYTES:
                await asyncio.to_thread(sink.feed, parser, b"".join(pending))
                pending, size = [], 0
            if sink.request is not None and not checked:
                check_request(sink.request)
                checked = True
        if pending:
            await asyncio.to_thread(sink.feed, parser, b"".join(pending))
        parser.finalize()
        pushed = sink.finish()
        if not checked:
            check_request(pushed.request)
        kept = True
        return pushed
    finally:
        await asyncio.to_thread(sink.close, kept)
