"""On a server started with `--art-allow-unauthenticated` (the shared `lora` server), updates
work without a key; and what stays refused there: an adapter file that leads out of the
allowed roots (403 naming the file), and a body over the default 16 MiB limit (413, after
which the server goes on serving and updating). The refusal without the flag:
`test_refuse_strangers.py`."""

from __future__ import annotations

import os
import shutil

import httpx
import pytest

from art_vllm_plugin.adapters import CONFIG_FILE, WEIGHTS_FILE

DEFAULT_LIMIT = 16 * 1024 * 1024


@pytest.fixture(scope="module")
def server(lora_server):
    """The shared `lora` server: no key, `--art-allow-unauthenticated`, adapter roots
    `.cache/tiny/adapters` and the kind's own directory (where `scratch` lies)."""
    return lora_server


def _version(server) -> int:
    slots = httpx.get(server.url + "/art/v1/slots", timeout=60).json()
    return {s["slot"]: s["version"] for s in slots}["policy"]


def _update(server, path, version) -> httpx.Response:
    body = {"slot": "policy", "path": str(path), "version": version}
    return httpx.post(server.url + "/art/v1/lora/update", json=body, timeout=300)


def test_the_flag_opens_updates_without_a_key(server, tiny_adapters):
    assert "--art-allow-unauthenticated" in server.config.args
    assert "--api-key" not in server.config.args
    adapter = shutil.copytree(tiny_adapters / "b", server.scratch / "b")
    version = _version(server) + 1
    resp = _update(server, adapter, version)
    assert resp.status_code == 200, resp.text
    assert _version(server) == version


@pytest.mark.parametrize("name", [WEIGHTS_FILE, CONFIG_FILE])
def test_a_file_linked_out_of_the_roots_is_403_naming_it(server, tiny_adapters, tmp_path, name):
    """The directory lies inside a root; one of its files is a symlink to a valid adapter's
    file outside every root (before: read through the link, and the update committed)."""
    outside = shutil.copytree(tiny_adapters / "c", tmp_path / "outside")
    linked = shutil.copytree(tiny_adapters / "c", server.scratch / f"linked-{name}")
    (linked / name).unlink()
    os.symlink(outside / name, linked / name)
    before = _version(server)
    resp = _update(server, linked, before + 1)
    assert resp.status_code == 403, resp.text
    message = resp.json()["error"]["message"]
    assert f"adapter file {linked / name} resolves to {(outside / name).resolve()}" in message
    assert f"slot 'policy' keeps serving version {before}" in message
    assert _version(server) == before


def test_a_body_over_the_default_limit_is_413_and_the_server_goes_on(server, tiny_adapters):
    before = _version(server)
    body = {"slot": "policy", "path": "x" * DEFAULT_LIMIT, "version": before + 1}
    resp = httpx.post(server.url + "/art/v1/lora/update", json=body, timeout=300)
    assert resp.status_code == 413, resp.text
    message = resp.json()["error"]["message"]
    assert f"limit of {DEFAULT_LIMIT} bytes" in message and "--art-max-body-bytes" in message

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(17):
            yield b" " * (1024 * 1024)

    resp = httpx.post(
        server.url + "/art/v1/lora/update",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=300,
    )
    assert resp.status_code == 413, resp.text
    assert f"more than {DEFAULT_LIMIT} bytes sent" in resp.json()["error"]["message"]
    assert httpx.get(server.url + "/health", timeout=60).status_code == 200
    adapter = shutil.copytree(tiny_adapters / "c", server.scratch / "after-413")
    resp = _update(server, adapter, before + 1)
    assert resp.status_code == 200, resp.text
