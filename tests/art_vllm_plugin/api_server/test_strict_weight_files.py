"""Strict files for full-weight updates, on a real server (the shared `keyed` server: one
`--art-adapter-root`, the tiny model served from its local directory). A checkpoint directory
inside the root whose `model.safetensors` is a symlink to a file outside every root is
refused (403 naming the file; before: copied through the link and committed, 200), as an
adapter's files are; a truncated shard is 422 naming the file (before: 500 "Error while
deserializing header"). Nothing changes either way. As units: `test_base_files.py`."""

from __future__ import annotations

import os
import shutil

import httpx
import pytest

ROUTE = "/art/v1/weights/update"


@pytest.fixture(scope="module")
def server(keyed_server):
    """The shared `keyed` server; every update here is refused, so its base weights stay the
    model's (version 0) for the modules after it."""
    return keyed_server


def _base_version(server) -> int:
    resp = httpx.get(server.url + "/art/v1/weights", headers=server.headers, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["version"]


def _update(server, path) -> httpx.Response:
    body = {"path": str(path), "version": _base_version(server) + 1}
    return httpx.post(server.url + ROUTE, json=body, headers=server.headers, timeout=600)


def test_a_weights_file_linked_out_of_the_roots_is_403_naming_it(server, tiny_model, tmp_path):
    outside = tmp_path / "outside.safetensors"  # the served model's own weights: valid
    shutil.copyfile(tiny_model / "model.safetensors", outside)
    linked = server.scratch / "linked"
    linked.mkdir()
    os.symlink(outside, linked / "model.safetensors")
    before = _base_version(server)
    resp = _update(server, linked)
    assert resp.status_code == 403, resp.text
    message = resp.json()["error"]["message"]
    assert f"checkpoint file {linked / 'model.safetensors'} resolves to {outside}" in message
    assert f"keep serving version {before}" in message
    assert _base_version(server) == before


def test_a_truncated_weights_file_is_422_naming_it(server, tiny_model):
    cut = server.scratch / "truncated"
    cut.mkdir()
    data = (tiny_model / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) - 1000])
    before = _base_version(server)
    resp = _update(server, cut)
    assert resp.status_code == 422, resp.text
    message = resp.json()["error"]["message"]
    assert f"the full weights at {cut} does not fit the served model" in message
    assert f"model.safetensors: truncated: the file holds {len(data) - 1000} bytes" in message
    assert _base_version(server) == before
