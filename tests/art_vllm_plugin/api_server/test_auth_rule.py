"""Who may call which `/art` route (`api_server/auth.py`), checked on every route the plugin
really serves: without a key, reads and generation are open and every other route is refused
(403, naming `--api-key` and `--art-allow-unauthenticated`) unless the server was started
with `--art-allow-unauthenticated`; with a key, every route needs it (401). The same rule on
a real server: `test_refuse_strangers.py` and `test_open_routes.py`."""

from __future__ import annotations

import asyncio
import hashlib
from types import SimpleNamespace

import pytest
from fastapi import HTTPException
from starlette.requests import Request

from art_vllm_plugin.api_server import auth, route_completions, routes

KEY = "k3y"
DIGESTS = [hashlib.sha256(KEY.encode()).digest()]
#: The routes that change state today (a route added later is refused too: the rule is
#: "everything but reads and generation").
STATE_CHANGING = {
    ("POST", "/art/v1/lora/update"),
    ("POST", "/art/v1/leases"),
    ("DELETE", "/art/v1/leases/{lease_id}"),
    ("POST", "/art/v1/test/fault"),
    ("POST", "/art/v1/test/hold"),
}


def _served() -> list[tuple[str, str]]:
    """(method, route template) of every route of the plugin's `/art` routers."""
    return sorted(
        (method, route.path)
        for router in (routes.router, route_completions.router)
        for route in router.routes
        for method in route.methods
    )


def test_the_state_changing_routes_served_today_are_refused():
    served = set(_served())
    assert served >= STATE_CHANGING  # this list is the routers' own
    for method, route in STATE_CHANGING:
        assert auth.refusal(method, route, None, [], allow_unauthenticated=False)[0] == 403


@pytest.mark.parametrize(("method", "route"), _served())
def test_without_a_key_only_reads_and_generation_are_open(method, route):
    refused = auth.refusal(method, route, None, [], allow_unauthenticated=False)
    if method == "GET" or route in auth.GENERATION_ROUTES:
        assert refused is None
        return
    status, message = refused
    assert status == 403
    assert f"{method} {route}" in message
    assert "--api-key" in message and "--art-allow-unauthenticated" in message


@pytest.mark.parametrize(("method", "route"), sorted(STATE_CHANGING))
def test_the_flag_opens_the_state_changing_routes(method, route):
    assert auth.refusal(method, route, None, [], allow_unauthenticated=True) is None


@pytest.mark.parametrize(("method", "route"), _served())
def test_with_a_key_every_route_needs_it(method, route):
    for allow in (False, True):  # the flag opens nothing on a keyed server
        assert auth.refusal(method, route, None, DIGESTS, allow)[0] == 401
        assert auth.refusal(method, route, "Bearer wrong", DIGESTS, allow)[0] == 401
        assert auth.refusal(method, route, f"Bearer {KEY}", DIGESTS, allow) is None


def _request(method: str, route: str, state) -> Request:
    app = SimpleNamespace(state=SimpleNamespace(art=state))
    scope = {
        "type": "http",
        "method": method,
        "path": route.replace("{lease_id}", "abc"),
        "headers": [],
        "query_string": b"",
        "app": app,
        "route": SimpleNamespace(path=route),
    }
    return Request(scope)


def test_the_dependency_applies_the_rule_to_the_matched_route():
    closed = SimpleNamespace(api_key_digests=[], allow_unauthenticated=False)
    with pytest.raises(HTTPException) as refused:
        asyncio.run(auth.require_api_key(_request("DELETE", "/art/v1/leases/{lease_id}", closed)))
    assert refused.value.status_code == 403
    assert "DELETE /art/v1/leases/{lease_id}" in refused.value.detail
    asyncio.run(auth.require_api_key(_request("GET", "/art/v1/slots", closed)))
    opened = SimpleNamespace(api_key_digests=[], allow_unauthenticated=True)
    asyncio.run(auth.require_api_key(_request("POST", "/art/v1/lora/update", opened)))


def test_before_the_state_exists_state_changes_are_refused():
    with pytest.raises(HTTPException) as refused:
        asyncio.run(auth.require_api_key(_request("POST", "/art/v1/lora/update", None)))
    assert refused.value.status_code == 403
