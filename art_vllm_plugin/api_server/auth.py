"""API-key guard for every `/art/*` route, the same rule vLLM applies to its own `/v1/*`.

When the server has a key (`--api-key`, repeatable, or `VLLM_API_KEY`), each `/art/*` request
must carry `Authorization: Bearer <key>`, else 401. State-changing routes are therefore never
reachable without the key; read-only ones are guarded exactly as `/v1/models` is. Keys are
compared as SHA-256 digests in constant time.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Iterable

from fastapi import HTTPException, Request


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


async def require_api_key(request: Request) -> None:
    state = getattr(request.app.state, "art", None)
    digests = state.api_key_digests if state is not None else []
    if digests and not key_matches(request.headers.get("Authorization"), digests):
        raise HTTPException(
            status_code=401,
            detail="missing or wrong API key for /art routes (send Authorization: Bearer <key>)",
        )
