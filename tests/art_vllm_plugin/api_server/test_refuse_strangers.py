"""A server started without an API key and without `--art-allow-unauthenticated` refuses
every state-changing `/art` request (403, naming both flags) and changes nothing, and so does
vLLM's own control routes (dev mode: `/pause`, `/update_weights`, ...), while reads
and generation answer as on any server; bodies over its `--art-max-body-bytes` get 413 and it
keeps serving. On a real `vllm serve` of the tiny model. The same rule route by route, and the
middleware, as units: `test_auth_rule.py`, `test_body_limits.py`."""

from __future__ import annotations

import shutil

import httpx
import pytest

from art_vllm_plugin import serve_process

#: This server's `--art-max-body-bytes` (small, so that a refused body is cheap to send).
BODY_LIMIT = 4096


@pytest.fixture(scope="module")
def server(tiny_model, tiny_adapters, tmp_path_factory, server_log):
    """A server of its own: every shared kind either has a key or runs with
    `--art-allow-unauthenticated` (their hand-over publishes), and the default this module
    checks is a server with neither. Test hooks and vLLM's dev mode on, so that refusing the
    fault and hold routes and vLLM's control routes is the guard's doing, not their absence."""
    root = tmp_path_factory.mktemp("strangers")
    for name in ("a", "b"):
        shutil.copytree(tiny_adapters / name, root / name)
    config = serve_process.ServeConfig(
        model=str(tiny_model),
        args=(
            *serve_process.tiny_lora_args(),
            *("--lora-modules", f"policy={root / 'a'}", "--art-adapter-root", str(root)),
            *("--art-max-body-bytes", str(BODY_LIMIT)),
        ),
        env={"ART_TEST_HOOKS": "1", "VLLM_SERVER_DEV_MODE": "1"},
        unset_env=("VLLM_PLUGINS", "VLLM_API_KEY"),
        log_path=server_log,
    )
    with serve_process.serving(config) as srv:
        srv.root = root
        yield srv


def _slots(server) -> dict[str, dict]:
    resp = httpx.get(server.url + "/art/v1/slots", timeout=60)
    assert resp.status_code == 200, resp.text
    return {s["slot"]: s for s in resp.json()}


def _assert_refused(resp: httpx.Response, method: str, route: str) -> None:
    assert resp.status_code == 403, resp.text
    message = resp.json()["error"]["message"]
    assert f"{method} {route} changes the server's state" in message
    assert "--api-key" in message and "--art-allow-unauthenticated" in message


def test_an_update_is_refused_and_changes_nothing(server):
    before = _slots(server)["policy"]
    resp = httpx.post(
        server.url + "/art/v1/lora/update",
        json={"slot": "policy", "path": str(server.root / "b"), "version": before["version"] + 1},
        timeout=120,
    )
    _assert_refused(resp, "POST", "/art/v1/lora/update")
    after = _slots(server)["policy"]
    assert (after["version"], after["digest"]) == (before["version"], before["digest"])


def test_leases_and_test_hooks_are_refused(server):
    version = _slots(server)["policy"]["version"]
    calls = [
        ("POST", "/art/v1/leases", {"slot": "policy", "version": version, "ttl_s": 60}),
        ("POST", "/art/v1/test/fault", {"kind": "commit", "rank": 0}),
        ("POST", "/art/v1/test/hold", {"step": 10**9}),
    ]
    for method, route, body in calls:
        resp = httpx.request(method, server.url + route, json=body, timeout=60)
        _assert_refused(resp, method, route)
    resp = httpx.delete(server.url + "/art/v1/leases/0123456789abcdef", timeout=60)
    _assert_refused(resp, "DELETE", "/art/v1/leases/{lease_id}")
    assert httpx.get(server.url + "/art/v1/leases", timeout=60).json() == []


@pytest.mark.parametrize("route", ["/pause", "/sleep", "/collective_rpc", "/update_weights"])
def test_vllms_control_routes_are_refused_too(server, route):
    """Before: `/pause` paused the server for anyone (200); now the `/art` rule holds."""
    resp = httpx.post(server.url + route, json={}, timeout=60)
    _assert_refused(resp, "POST", route)
    assert httpx.get(server.url + "/is_paused", timeout=60).json()["is_paused"] is False


@pytest.mark.parametrize(
    "route",
    ["/art/v1/slots", "/art/metrics", "/art/v1/capabilities", "/art/v1/engine", "/v1/models"],
)
def test_reads_stay_open(server, route):
    assert httpx.get(server.url + route, timeout=60).status_code == 200


def test_generation_stays_open(server):
    body = {"model": "policy", "prompt": "the policy", "max_tokens": 4, "temperature": 0}
    for route in ("/v1/completions", "/art/v1/completions"):
        resp = httpx.post(server.url + route, json=body, timeout=120)
        assert resp.status_code == 200, (route, resp.text)
        assert resp.json()["choices"][0]["text"] is not None


def test_capabilities_say_state_changes_are_refused(server):
    guard = httpx.get(server.url + "/art/v1/capabilities", timeout=60).json()["features"]
    assert guard["guarded_routes"]["enabled"] is False
    assert "state-changing routes are refused (403)" in guard["guarded_routes"]["reason"]


def _too_large(resp: httpx.Response, seen: str) -> None:
    assert resp.status_code == 413, resp.text
    message = resp.json()["error"]["message"]
    assert f"larger than the limit of {BODY_LIMIT} bytes ({seen})" in message
    assert "--art-max-body-bytes" in message


def test_a_body_over_the_limit_is_413_and_the_server_keeps_serving(server):
    version = _slots(server)["policy"]["version"]
    body = {"slot": "policy", "path": "x" * BODY_LIMIT, "version": version + 1}
    resp = httpx.post(server.url + "/art/v1/lora/update", json=body, timeout=60)
    _too_large(resp, f"Content-Length {len(resp.request.content)}")

    def chunks():  # no Content-Length: the server counts what arrives
        for _ in range(8):
            yield b"x" * 1024

    resp = httpx.post(
        server.url + "/art/v1/leases",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert resp.request.headers.get("transfer-encoding") == "chunked"
    _too_large(resp, f"more than {BODY_LIMIT} bytes sent")
    assert httpx.get(server.url + "/health", timeout=60).status_code == 200
    assert _slots(server)["policy"]["version"] == version


def test_a_multipart_push_is_not_held_to_the_json_limit(server):
    """Over the JSON limit, a multipart body to the update route meets the guard (403), not
    the 413: pushes have their own limit (`--art-max-adapter-bytes`)."""
    files = {"adapter_model.safetensors": ("w", b"x" * (2 * BODY_LIMIT))}
    resp = httpx.post(server.url + "/art/v1/lora/update", files=files, timeout=60)
    _assert_refused(resp, "POST", "/art/v1/lora/update")
