"""`GET /art/metrics`, served by an outermost ASGI middleware because it must be cheap.

A FastAPI route would run behind every middleware vLLM installs (request ids, Prometheus
instrumentation of each request, ...) and through FastAPI's dependency and response-model
machinery: that fixed cost is most of a small request. This middleware, added last and so run
first, answers `GET /art/metrics` itself and passes everything else through untouched. It
checks the API key with the same rule as the other `/art/*` routes, formats the in-memory
snapshot with `json.dumps`, and answers 503 when `?max_age_s=X` is given and the snapshot is
older than X seconds, so a client can insist on fresh numbers. Slot fields are EngineCore's
registry, so every API server reports the same ones; it is read again only after it changed
(one API server: after its own updates; several: when engine 0 pushes a new registry
generation, `ApiServerState.registry_slots`), so an answer does not wait for an engine step.
With several API servers the first answer subscribes to the engines' figures
(`ApiServerState.follow_engines`).
"""

from __future__ import annotations

import json
from urllib.parse import parse_qs

from art_vllm_plugin.api_server.auth import UNAUTHORIZED, key_matches
from art_vllm_plugin.api_server.metrics_feed import FEED

PATH = "/art/metrics"


def _error(status: int, message: str) -> tuple[int, dict]:
    return status, {"error": {"message": message, "code": status}}


async def render(art, query_string: bytes, authorization: str | None) -> tuple[int, dict]:
    if art.api_key_digests and not key_matches(authorization, art.api_key_digests):
        return 401, {"detail": UNAUTHORIZED}
    await art.follow_engines()
    slots = await art.registry_slots()
    snap = FEED.snapshot(slots.values(), art.updates.failed_unattributed)
    snap["base_version"] = art.slots.base.get("version", 0)
    snap["base_blocked"] = art.slots.base.get("blocked")
    raw = parse_qs(query_string.decode("latin-1")).get("max_age_s", [None])[0]
    if raw is None:
        return 200, snap
    try:
        max_age = float(raw)
    except ValueError:
        return _error(400, f"max_age_s must be a number, got {raw!r}")
    if snap["age_s"] > max_age:
        return _error(
            503,
            f"metrics snapshot is {snap['age_s']:.3f}s old, older than "
            f"max_age_s={raw} (no engine step reported since "
            f"{snap['snapshot_time']:.3f})",
        )
    return 200, snap


class ArtMetricsMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != PATH or scope["method"] != "GET":
            return await self.app(scope, receive, send)
        authorization = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
        status, payload = await render(scope["app"].state.art, scope["query_string"], authorization)
        body = json.dumps(payload, separators=(",", ":")).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
