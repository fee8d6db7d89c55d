"""vLLM's own control routes under the plugin (`api_server/control_routes.py`), as units: the
rule route by route, which routes vLLM 0.32's dev-mode and RL routers register (found by
`compat.api_server.control_routes` on an app built with vLLM's own registration), and the
middleware on that app, with a stand-in engine client (nothing refused may reach it). The
same on a real keyed server: `test_control_routes_keyed.py`."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from art_vllm_plugin.api_server import control_routes
from art_vllm_plugin.compat.api_server import control_routes as vllm_control_routes

KEY = "k3y"
DIGESTS = [hashlib.sha256(KEY.encode()).digest()]
BEARER = f"Bearer {KEY}"
#: The routes that leave the weights alone (the key is all they need).
KEEP_WEIGHTS = ["/pause", "/resume", "/sleep", "/wake_up", "/reset_prefix_cache"]


def _decide(path, authorization=None, digests=DIGESTS, allow=False, query="", body=None):
    return control_routes.decide("POST", path, query, body, authorization, digests, allow)


@pytest.mark.parametrize("path", sorted(control_routes.NAMED))
def test_with_a_key_every_named_route_needs_it(path):
    status, message = _decide(path)
    assert status == 401 and f"POST {path}" in message
    assert _decide(path, "Bearer wrong")[0] == 401


@pytest.mark.parametrize("path", sorted(control_routes.NAMED))
def test_without_a_key_they_are_refused_unless_the_operator_opted_in(path):
    status, message = _decide(path, digests=[])
    assert status == 403 and "--api-key" in message and "--art-allow-unauthenticated" in message
    opened = _decide(path, digests=[], allow=True)
    assert (opened is None) == (path in KEEP_WEIGHTS)


@pytest.mark.parametrize("path", KEEP_WEIGHTS)
def test_with_the_key_the_routes_that_keep_the_weights_pass(path):
    assert _decide(path, BEARER) is None


@pytest.mark.parametrize("path", sorted(control_routes.WEIGHT_ROUTES))
def test_with_the_key_weight_changes_are_409_naming_the_art_route(path):
    status, message = _decide(path, BEARER)
    assert status == 409
    assert f"POST {path} changes the served weights" in message
    assert "POST /art/v1/weights/update" in message and "nothing was called" in message


def test_sleep_level_2_and_a_weight_reset_are_weight_changes():
    assert _decide("/sleep", BEARER, query="level=2")[0] == 409
    assert _decide("/sleep", BEARER, query="level=1&mode=wait") is None
    assert _decide("/sleep", BEARER, query="level=0") is None
    reset = _decide("/weight_checker", BEARER, body=b'{"action": "reset"}')
    assert reset is not None and reset[0] == 409 and "overwrites the served weights" in reset[1]
    assert _decide("/weight_checker", BEARER, body=b'{"action": "checksum"}') is None
    assert _decide("/weight_checker", BEARER, body=b"not json") is None  # vLLM answers 400


@pytest.fixture(scope="module")
def vllm_app():
    """An app with vLLM 0.32's own dev-mode and RL routers, the guard, and a stand-in engine
    client that records what reaches it."""
    from vllm.entrypoints.rl.factories import register_rl_api_routers
    from vllm.entrypoints.serve import register_vllm_dev_api_routers

    app = FastAPI()
    register_vllm_dev_api_routers(app)
    register_rl_api_routers(app)
    paths = vllm_control_routes(app)
    app.add_middleware(control_routes.ControlRouteGuard, paths=paths)
    calls = []

    async def compute_weight_checksums():
        calls.append("compute_weight_checksums")
        return [{"w": "c0"}]

    async def is_paused():
        calls.append("is_paused")
        return False

    app.state.engine_client = SimpleNamespace(
        compute_weight_checksums=compute_weight_checksums, is_paused=is_paused
    )
    app.state.art = SimpleNamespace(api_key_digests=DIGESTS, allow_unauthenticated=False)
    return app, paths, calls


def test_vllm_registers_the_named_routes_from_its_control_routers(vllm_app):
    _, paths, _ = vllm_app
    assert paths >= control_routes.NAMED
    assert {"/abort_requests", "/update_weight_version", "/weight_checker"} <= paths
    assert not {"/is_paused", "/is_sleeping", "/get_world_size"} & paths  # reads only


def test_the_middleware_refuses_before_the_engine_and_passes_the_rest(vllm_app):
    app, paths, calls = vllm_app
    client = TestClient(app)
    for path in sorted(paths):
        resp = client.post(path, json={})
        assert resp.status_code == 401, (path, resp.text)
        assert resp.json()["error"]["message"].startswith("missing or wrong API key for POST")
    headers = {"Authorization": BEARER}
    resp = client.post("/update_weights", json={"update_info": {}}, headers=headers)
    assert resp.status_code == 409 and "/art/v1/weights/update" in resp.text
    resp = client.post("/collective_rpc", json={"method": "reload_weights"}, headers=headers)
    assert resp.status_code == 409
    assert calls == []
    # a read, and a checksum whose body the guard read and handed on intact
    assert client.get("/is_paused").json() == {"is_paused": False}
    resp = client.post("/weight_checker", json={"action": "checksum"}, headers=headers)
    assert resp.status_code == 200 and resp.json() == {"checksums": {"w": "c0"}}
    resp = client.post("/weight_checker", json={"action": "reset"}, headers=headers)
    assert resp.status_code == 409
    assert calls == ["is_paused", "compute_weight_checksums"]
