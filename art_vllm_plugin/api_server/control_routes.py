"""vLLM's own control routes while the plugin is active: the key, and no weight change past it.

Why: vLLM's RL guides ask for `VLLM_SERVER_DEV_MODE=1`, which adds control routes outside
`/v1` (`/pause`, `/resume`, `/sleep`, `/wake_up`, `/reset_prefix_cache`, `/collective_rpc`,
the weight-transfer family `/init_weight_transfer_engine` ... `/finish_weight_update`).
vLLM's API key check covers `/v1/*` only, so on a server started with `--api-key` a stranger
could pause it, and `POST /update_weights` reached the workers (and, with no weight transfer
configured, ended EngineCore and every request on it). And where a caller has the key,
vLLM's weight routes write the weights with no base version, label, cache salt or receipt:
tokens would carry a label that names other weights.

So, for every such route (the ones above, and any other non-read route vLLM registers from
its control routers: `compat.control_routes`):
- the `/art` rule of `auth.refusal` applies: with a key, the key (401); without one, refused
  (403) unless the server was started with `--art-allow-unauthenticated`;
- the routes that change the weights are then refused whoever calls (409, naming
  `/art/v1/weights/update`, which does the same under the plugin's versioning) before
  anything reaches the engine: the weight-transfer family, `/update_weight_version` (a label
  the plugin did not set), `/collective_rpc` (it runs any worker method, weight writes
  included; which ones is not knowable from the route), `/sleep?level=2` (it discards the
  weights) and `/weight_checker` with `"action": "reset"`.
Reads (`/is_paused`, `/is_sleeping`, `/get_world_size`, ...) answer as vLLM answers them.
"""

from __future__ import annotations

import json
from urllib.parse import parse_qs

from art_vllm_plugin.api_server.auth import refusal

#: The control routes the issue named; guarded even if vLLM registered one from elsewhere.
NAMED = frozenset(
    {
        "/pause",
        "/resume",
        "/sleep",
        "/wake_up",
        "/reset_prefix_cache",
        "/collective_rpc",
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
    }
)
#: Routes that change the served weights (or their label) whatever their body says.
WEIGHT_ROUTES = frozenset(
    {
        "/init_weight_transfer_engine",
        "/shutdown_weight_transfer_engine",
        "/start_weight_update",
        "/start_draft_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/update_weight_version",
        "/collective_rpc",
    }
)
UPDATE_ROUTE = "/art/v1/weights/update"
#: Largest body read to tell a `/weight_checker` reset from a checksum (a baseline of one
#: checksum per tensor: a few MB for the largest models).
MAX_PEEK_BYTES = 64 * 1024 * 1024


def weight_change(path: str, query: str, body: bytes | None) -> str | None:
    """Why a call to control route `path` would change the weights outside the plugin's
    versioning, or None."""
    if path in WEIGHT_ROUTES:
        return f"POST {path} changes the served weights (or their version label)"
    if path == "/sleep" and parse_qs(query).get("level", ["1"])[-1].strip() == "2":
        return "POST /sleep?level=2 discards the served weights"
    if path == "/weight_checker" and body is not None:
        try:
            action = json.loads(body).get("action")
        except (ValueError, AttributeError):
            return None  # vLLM answers the malformed body itself
        if action == "reset":
            return 'POST /weight_checker {"action": "reset"} overwrites the served weights'
    return None


def refused(what: str) -> tuple[int, str]:
    return (
        409,
        f"{what} outside the art plugin's versioning (no base version, label, cache salt or "
        "receipt: tokens would be labelled with weights they were not computed with); nothing "
        f"was called and the served weights are unchanged. Publish full weights with POST "
        f"{UPDATE_ROUTE} (a checkpoint directory, or a stream after POST "
        "/art/v1/weights/transfer/init)",
    )


def decide(
    method: str,
    path: str,
    query: str,
    body: bytes | None,
    authorization: str | None,
    digests: list[bytes],
    allow_unauthenticated: bool,
) -> tuple[int, str] | None:
    """(status, message) when a call to control route `path` must be refused, else None: the
    key first (a stranger learns nothing more), then a weight change."""
    denied = refusal(method, path, authorization, digests, allow_unauthenticated)
    if denied is not None:
        return denied
    why = weight_change(path, query, body)
    return refused(why) if why is not None else None


async def _read_body(receive) -> tuple[bytes, list[dict]]:
    chunks, messages, size = [], [], 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_PEEK_BYTES:
            return b"", messages
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks), messages


class ControlRouteGuard:
    """ASGI middleware applying `decide` to the non-read calls of `paths` (and of `NAMED`)."""

    def __init__(self, app, paths: frozenset[str]):
        self.app = app
        self.paths = frozenset(paths) | NAMED

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        path = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        if path not in self.paths:
            return await self.app(scope, receive, send)
        body, replay = None, []
        if path == "/weight_checker":
            body, replay = await _read_body(receive)
        state = getattr(scope["app"].state, "art", None)
        headers = dict(scope["headers"])
        authorization = headers.get(b"authorization", b"").decode("latin-1") or None
        denied = decide(
            scope["method"],
            path,
            scope.get("query_string", b"").decode("latin-1"),
            body,
            authorization,
            state.api_key_digests if state is not None else [],
            bool(getattr(state, "allow_unauthenticated", False)),
        )
        if denied is not None:
            return await _answer(send, *denied)
        if replay:
            receive = _replaying(replay, receive)
        return await self.app(scope, receive, send)


def _replaying(messages: list[dict], receive):
    pending = list(messages)

    async def replay():
        return pending.pop(0) if pending else await receive()

    return replay


async def _answer(send, status: int, message: str) -> None:
    kind = {401: "Unauthorized", 403: "Forbidden", 409: "Conflict"}.get(status, "Error")
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
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
