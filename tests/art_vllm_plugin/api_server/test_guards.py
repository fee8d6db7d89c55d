"""Guarded `/art/*` routes (API key) and safe adapter paths, on a real server (the shared
`keyed` server: `--api-key`, one `--art-adapter-root` and a trainer path map)."""

from __future__ import annotations

import os
import shutil

import httpx
import pytest
from support.server_kinds import KEYED_API_KEY as KEY


@pytest.fixture(scope="module")
def server(keyed_server):
    """The shared `keyed` server (tests/support/server_kinds.py): `--api-key KEY`, adapter
    root `<root>/allowed`, `--art-path-map /trainer/ckpts=<root>/allowed`."""
    return keyed_server


@pytest.fixture(scope="module")
def roots(server, tiny_adapters):
    """The server's allowed root and a directory outside it, with adapters in both."""
    allowed, outside = server.paths.root / "allowed", server.paths.root / "outside"
    for name in ("a", "b", "c"):
        shutil.copytree(tiny_adapters / name, allowed / name)
    shutil.copytree(tiny_adapters / "c", outside / "c")
    os.symlink(outside / "c", allowed / "escape")  # a link inside the root that leaves it
    return {"allowed": allowed, "outside": outside}


def call(server, method, route, key=None, json=None):
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.request(method, server.url + route, headers=headers, json=json, timeout=60)


ROUTES = [
    ("GET", "/art/v1/capabilities"),
    ("GET", "/art/v1/slots"),
    ("GET", "/art/v1/engine"),
    ("GET", "/art/metrics"),
    ("POST", "/art/v1/lora/update"),
]


@pytest.mark.parametrize(("method", "route"), ROUTES)
def test_every_art_route_needs_the_key(server, method, route):
    body = {"slot": "policy", "path": "/trainer/ckpts/b", "version": 10**6}
    assert call(server, method, route, json=body).status_code == 401
    assert call(server, method, route, key="wrong", json=body).status_code == 401


@pytest.mark.parametrize(("method", "route"), ROUTES[:4])
def test_read_routes_answer_with_the_right_key(server, method, route):
    assert call(server, method, route, key=KEY).status_code == 200


def test_capabilities_report_the_guard_as_on(server):
    features = call(server, "GET", "/art/v1/capabilities", key=KEY).json()["features"]
    assert features["guarded_routes"]["enabled"] is True


def test_vllm_v1_routes_follow_the_same_rule(server):
    assert httpx.get(server.url + "/v1/models", timeout=60).status_code == 401
    assert call(server, "GET", "/v1/models", key=KEY).status_code == 200


def _version(server):
    slots = call(server, "GET", "/art/v1/slots", key=KEY).json()
    return {s["slot"]: s["version"] for s in slots}["policy"]


def test_update_with_the_key_through_a_trainer_path_map(server, roots):
    v = _version(server) + 1
    resp = call(
        server,
        "POST",
        "/art/v1/lora/update",
        key=KEY,
        json={"slot": "policy", "path": "/trainer/ckpts/b", "version": v},
    )
    assert resp.status_code == 200, resp.text
    slots = call(server, "GET", "/art/v1/slots", key=KEY).json()
    (slot,) = [s for s in slots if s["slot"] == "policy"]
    assert slot["version"] == v
    assert slot["path"] == str((roots["allowed"] / "b").resolve())


@pytest.mark.parametrize("case", ["dotdot", "symlink_escape", "outside_root"])
def test_paths_leaving_the_roots_are_refused(server, roots, case):
    before = _version(server)
    path = {
        "dotdot": f"{roots['allowed']}/../outside/c",
        "symlink_escape": str(roots["allowed"] / "escape"),
        "outside_root": str(roots["outside"] / "c"),
    }[case]
    resp = call(
        server,
        "POST",
        "/art/v1/lora/update",
        key=KEY,
        json={"slot": "policy", "path": path, "version": before + 1},
    )
    assert resp.status_code == 403, resp.text
    message = resp.json()["error"]["message"]
    if case == "dotdot":
        assert "contains '..'" in message
    else:
        assert str((roots["outside"] / "c").resolve()) in message
        assert "outside every allowed root" in message
    assert _version(server) == before
