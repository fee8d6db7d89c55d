"""Nothing bypasses the plugin: vLLM's own control routes on a real server started as vLLM's
RL guides ask (`--api-key`, `VLLM_SERVER_DEV_MODE=1`: the shared `keyed` server). Before,
`POST /pause` without the key answered 200, and `POST /update_weights` without it reached the
workers and ended EngineCore. Now every control route needs the key (401), the weight-changing
ones are refused with it too (409, naming `/art/v1/weights/update`), nothing refused reaches
the engine, and the server goes on serving. The rule route by route: `test_control_route_rule.py`.
"""

from __future__ import annotations

import httpx
import pytest
from support.server_kinds import KEYED_API_KEY as KEY

#: vLLM's state-changing control routes (dev mode and RL), as issue 36 lists them.
NAMED = [
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
]
BEARER = {"Authorization": f"Bearer {KEY}"}
#: A body each route accepts as far as its own parsing goes (vLLM 0.32's signatures).
BODIES = {
    "/collective_rpc": {"method": "reload_weights"},
    "/init_weight_transfer_engine": {"init_info": {}},
    "/update_weights": {"update_info": {}},
    "/finish_weight_update": {"weight_version": "x"},
}


@pytest.fixture(scope="module")
def server(keyed_server):
    """The shared `keyed` server: `--api-key`, dev mode (vLLM's control routes registered);
    nothing here changes its state (every call that would is refused)."""
    return keyed_server


def _post(server, path, headers=None, params=None):
    return httpx.post(
        server.url + path, json=BODIES.get(path, {}), headers=headers, params=params, timeout=120
    )


def _paused(server) -> bool:
    resp = httpx.get(server.url + "/is_paused", timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["is_paused"]


def _serves(server) -> None:
    resp = httpx.post(
        server.url + "/v1/completions",
        json={"model": "policy", "prompt": "hello", "max_tokens": 3},
        headers=BEARER,
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    assert httpx.get(server.url + "/health", timeout=60).status_code == 200


@pytest.mark.parametrize("path", NAMED)
def test_every_control_route_needs_the_key(server, path):
    for headers in (None, {"Authorization": "Bearer wrong"}):
        resp = _post(server, path, headers)
        assert resp.status_code == 401, (path, resp.text)
        assert f"missing or wrong API key for POST {path}" in resp.json()["error"]["message"]
    assert not _paused(server)


@pytest.mark.parametrize(
    "path",
    [
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/collective_rpc",
    ],
)
def test_weight_changes_are_409_with_the_key_and_the_engine_lives(server, path):
    resp = _post(server, path, BEARER)
    assert resp.status_code == 409, (path, resp.text)
    message = resp.json()["error"]["message"]
    assert "POST /art/v1/weights/update" in message and "nothing was called" in message
    _serves(server)


def test_sleep_level_2_is_409_and_nothing_sleeps(server):
    resp = _post(server, "/sleep", BEARER, params={"level": 2})
    assert resp.status_code == 409 and "discards the served weights" in resp.text
    assert httpx.get(server.url + "/is_sleeping", timeout=60).json()["is_sleeping"] is False
    _serves(server)


def test_with_the_key_pause_resume_and_cache_reset_work_as_vllms(server):
    assert _post(server, "/pause", BEARER, params={"mode": "keep"}).status_code == 200
    try:
        assert _paused(server)
    finally:
        assert _post(server, "/resume", BEARER).status_code == 200
    assert not _paused(server)
    assert _post(server, "/reset_prefix_cache", BEARER).status_code == 200
    _serves(server)
