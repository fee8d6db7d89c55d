"""Who may call the `/art/*` routes: the API key, and strangers refused by default.

When the server has a key (`--api-key`, repeatable, or `VLLM_API_KEY`), each `/art/*` request
must carry `Authorization: Bearer <key>`, else 401: the same rule vLLM applies to its own
`/v1/*`. Keys are compared as SHA-256 digests in constant time. vLLM's own control routes
outside `/v1` (`/pause`, `/update_weights`, ...) are held to this same rule while the plugin
is active (`control_routes.py`).

Without a key, reading stays open as `/v1/models` is (GET: slots, capabilities, engine, leases;
`/art/metrics` answers in `metrics_route.py` by the same rule), and so does generating
(`GENERATION_ROUTES`, like `/v1/completions`). Every other `/art` request changes the server's
state (an update, a lease, a test hook) and is refused with 403 naming both ways out, unless
the server was started with `--art-allow-unauthenticated`. Why refuse by default: a server
reachable on a network would otherwise let anyone replace the policy being trained. The rule
is "everything but reads and generation", not a list of state-changing routes, so a route
added later is guarded from its first day.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Iterable

from fastapi import HTTPException, Request

#: Methods that only read.
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
#: POST routes that only generate, open whenever vLLM's `/v1/completions` is.
GENERATION_ROUTES = frozenset({"/art/v1/completions", "/art/v1/chat/completions"})
ALLOW_FLAG = "--art-allow-unauthenticated"
UNAUTHORIZED = "missing or wrong API key for {request} (send Authorization: Bearer <key>)"


def configured_keys(cli_keys: Iterable[str] | None) -> list[bytes]:
    keys = [k for k in (list(cli_keys or []) or [os.environ.get("VLLM_API_KEY", "")]) if k]
    return [hashlib.sha256(k.encode()).digest() for k in keys]


def key_matches(header: str | None, digests: list[bytes]) -> bool:
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    got = hashlib.sha256(token.encode()).digest()
    match = False
    for digest in digests:
        match |= secrets.compare_digest(got, digest)
    return match


def changes_state(method: str, route: str) -> bool:
    """Whether a request to `route` (the route's template, e.g. `/art/v1/leases/{lease_id}`)
    may change the server's state: anything but a read or a generation."""
    return method.upper() not in READ_METHODS and route not in GENERATION_ROUTES


def refusal(
    method: str,
    route: str,
    authorization: str | None,
    digests: list[bytes],
    allow_unauthenticated: bool,
) -> tuple[int, str] | None:
    """(status, message) when the request must be refused, else None."""
    if digests:
        if key_matches(authorization, digests):
            return None
        return 401, UNAUTHORIZED.format(request=f"{method.upper()} {route}")
    if allow_unauthenticated or not changes_state(method, route):
        return None
    return (
        403,
        f"{method.upper()} {route} changes the server's state and this server has no API key; "
        "nothing changed. Start the server with --api-key KEY (or VLLM_API_KEY) and send "
        f"Authorization: Bearer KEY, or, on a trusted network only, with {ALLOW_FLAG}",
    )


async def require_api_key(request: Request) -> None:
    """The dependency of every `/art` router: applies `refusal` to the matched route."""
    state = getattr(request.app.state, "art", None)
    matched = request.scope.get("route")
    refused = refusal(
        request.method,
        getattr(matched, "path", None) or request.url.path,
        request.headers.get("Authorization"),
        state.api_key_digests if state is not None else [],
        bool(getattr(state, "allow_unauthenticated", False)),
    )
    if refused is not None:
        raise HTTPException(status_code=refused[0], detail=refused[1])
