"""Bodies to `/art` routes are bounded before any route parses them
(`api_server/body_limits.py`), driven here as the ASGI server drives the middleware: a
declared `Content-Length` over the limit is refused unread, a chunked body as soon as its
count passes the limit, a body within the limit reaches the route unchanged; multipart pushes
to the update route are left to their own limit. On a real server: `test_refuse_strangers.py`
(a small `--art-max-body-bytes`) and `test_open_routes.py` (the 16 MiB default)."""

from __future__ import annotations

import argparse
import asyncio
import json
from types import SimpleNamespace

import pytest

from art_vllm_plugin.api_server import body_limits
from art_vllm_plugin.api_server.body_limits import ArtBodyLimitMiddleware

LIMIT = 100


class Route:
    """The app behind the middleware: records what it received, answers 200."""

    def __init__(self, read: bool = True):
        self.read = read
        self.called = False
        self.body = b""

    async def __call__(self, scope, receive, send):
        self.called = True
        while self.read:
            message = await receive()
            self.body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def _scope(path: str, headers: dict[str, str], limit: int = LIMIT) -> dict:
    art = SimpleNamespace(max_body_bytes=limit)
    return {
        "type": "http",
        "method": "POST",
        "path": path,
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "app": SimpleNamespace(state=SimpleNamespace(art=art)),
    }


def _run(scope, chunks: list[bytes], route: Route) -> tuple[int, bytes, int]:
    """(status, response body, how many body messages the middleware took)."""
    pending = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]
    taken = 0
    sent: list[dict] = []

    async def receive():
        nonlocal taken
        if taken < len(pending):
            taken += 1
            return pending[taken - 1]
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(ArtBodyLimitMiddleware(route)(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:]), taken


JSON = {"content-type": "application/json"}


def test_declared_length_over_the_limit_is_refused_unread():
    route = Route()
    body = b"x" * (LIMIT + 1)
    status, answer, taken = _run(
        _scope("/art/v1/lora/update", {**JSON, "content-length": str(len(body))}), [body], route
    )
    assert status == 413 and taken == 0 and not route.called
    error = json.loads(answer)["error"]
    assert error["limit"] == LIMIT
    assert f"limit of {LIMIT} bytes" in error["message"]
    assert "--art-max-body-bytes" in error["message"]
    assert f"Content-Length {LIMIT + 1}" in error["message"]


def test_a_chunked_body_is_refused_once_its_count_passes_the_limit():
    route = Route()
    chunks = [b"x" * 40] * 10  # no Content-Length: counted as it streams
    status, answer, taken = _run(_scope("/art/v1/leases", JSON), chunks, route)
    assert status == 413 and not route.called
    assert taken == 3  # 120 bytes > 100: nothing more is read
    assert f"more than {LIMIT} bytes sent" in json.loads(answer)["error"]["message"]


@pytest.mark.parametrize("chunks", [[b"a" * LIMIT], [b"a" * 30, b"b" * 30, b"c" * 40], [b""]])
def test_a_body_within_the_limit_reaches_the_route_unchanged(chunks):
    route = Route()
    status, answer, _ = _run(_scope("/art/v1/lora/update", JSON), chunks, route)
    assert (status, answer) == (200, b"ok")
    assert route.body == b"".join(chunks)


def test_multipart_pushes_to_the_update_route_have_their_own_limit():
    route = Route()
    chunks = [b"x" * 80] * 4
    headers = {"content-type": "multipart/form-data; boundary=b", "content-length": "320"}
    status, _, _ = _run(_scope("/art/v1/lora/update", headers), chunks, route)
    assert status == 200 and route.body == b"".join(chunks)


def test_multipart_elsewhere_under_art_is_bounded():
    headers = {"content-type": "multipart/form-data; boundary=b", "content-length": "320"}
    status, _, _ = _run(_scope("/art/v1/leases", headers), [b"x" * 320], Route())
    assert status == 413


def test_routes_outside_art_are_untouched():
    route = Route()
    headers = {**JSON, "content-length": str(LIMIT * 10)}
    status, _, _ = _run(_scope("/v1/completions", headers), [b"x" * LIMIT * 10], route)
    assert status == 200 and len(route.body) == LIMIT * 10


def test_the_limit_comes_from_the_servers_flag():
    route = Route()
    headers = {**JSON, "content-length": "150"}
    status, _, _ = _run(_scope("/art/v1/leases", headers, limit=200), [b"x" * 150], route)
    assert status == 200


@pytest.mark.parametrize("value", ["0", "-5", "lots", "1.5"])
def test_the_flag_takes_a_positive_whole_number(value):
    with pytest.raises(argparse.ArgumentTypeError, match="--art-max-body-bytes expects"):
        body_limits.parse_max_body_bytes(value)
    assert body_limits.parse_max_body_bytes("4096") == 4096


def test_the_serve_options_carry_both_flags(capsys):
    """`vllm serve` gains them with the other art options (`cli.add_art_options`)."""
    from art_vllm_plugin.cli import add_art_options

    parser = argparse.ArgumentParser(prog="vllm serve")
    add_art_options(parser)
    defaults = parser.parse_args([])
    assert defaults.art_max_body_bytes == 16 * 1024 * 1024
    assert defaults.art_allow_unauthenticated is False
    given = parser.parse_args(["--art-max-body-bytes", "4096", "--art-allow-unauthenticated"])
    assert (given.art_max_body_bytes, given.art_allow_unauthenticated) == (4096, True)
    with pytest.raises(SystemExit):
        parser.parse_args(["--art-max-body-bytes", "0"])
    err = capsys.readouterr().err
    assert "--art-max-body-bytes expects a positive whole number of bytes" in err
