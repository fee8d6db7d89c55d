"""Request bodies to the `/art` routes, bounded before anything parses them.

Why: a route that calls `await request.json()` reads the whole body into memory first, so one
request with a multi-gigabyte body (or an endless chunked one) could exhaust the API server,
whatever the route then does with it. This ASGI middleware stands in front of every `/art`
route: a body over `--art-max-body-bytes` (default 16 MiB; the largest JSON an `/art` route
needs is a completion request) is answered 413, naming the limit and the flag, without being
handed on, and the server goes on serving.

How: a declared `Content-Length` over the limit is refused before a byte is read. Otherwise
(and for chunked bodies, which declare no length) the body is read here, counting, and refused
as soon as the count passes the limit; a body within the limit is replayed to the route
unchanged. After a 413 the server (uvicorn) reads and discards whatever the client still
sends, so the client gets the answer and the connection stays usable.

Exempt (`EXEMPT`): multipart adapter pushes to `POST /art/v1/lora/update`, which carry
adapter weights and are bounded by their own `--art-max-adapter-bytes`.
"""

from __future__ import annotations

import argparse
import json

PREFIX = "/art/"
FLAG = "--art-max-body-bytes"
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
#: (route, content type) -> the flag that bounds those bodies instead.
EXEMPT = {("/art/v1/lora/update", "multipart/form-data"): "--art-max-adapter-bytes"}


def parse_max_body_bytes(value: str) -> int:
    """`--art-max-body-bytes N`: a positive whole number of bytes."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(
            f"{FLAG} expects a positive whole number of bytes, got {value!r}"
        )
    return n


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def route_path(scope) -> str:
    """The path the routes see (`--root-path` taken off, as Starlette's router does)."""
    path, root = scope["path"], scope.get("root_path") or ""
    return path[len(root) :] if root and path.startswith(root) else path


def is_bounded(scope) -> bool:
    """Whether this request's body is held to `--art-max-body-bytes`."""
    if scope["type"] != "http" or not route_path(scope).startswith(PREFIX):
        return False
    content_type = (_header(scope, b"content-type") or "").split(";")[0].strip().lower()
    return (route_path(scope), content_type) not in EXEMPT


def declared_length(scope) -> int | None:
    raw = _header(scope, b"content-length")
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None  # h11/httptools refuse such a request before it gets here


def too_large(path: str, limit: int, seen: str) -> bytes:
    message = (
        f"request body to {path} is larger than the limit of {limit} bytes ({seen}); "
        f"the request was not processed. Send a smaller body, or start the server with a "
        f"larger {FLAG}"
    )
    return json.dumps({"error": {"message": message, "code": 413, "limit": limit}}).encode()


def _limit(scope) -> int:
    state = getattr(getattr(scope.get("app"), "state", None), "art", None)
    return int(getattr(state, "max_body_bytes", DEFAULT_MAX_BODY_BYTES))


class ArtBodyLimitMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if not is_bounded(scope):
            return await self.app(scope, receive, send)
        limit = _limit(scope)
        declared = declared_length(scope)
        if declared is not None and declared > limit:
            return await _refuse(send, route_path(scope), limit, f"Content-Length {declared}")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: nothing to serve
                return
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                return await _refuse(
                    send, route_path(scope), limit, f"more than {limit} bytes sent"
                )
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # then what the client does next (a disconnect)

        await self.app(scope, replay, send)


async def _refuse(send, path: str, limit: int, seen: str) -> None:
    body = too_large(path, limit, seen)
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
