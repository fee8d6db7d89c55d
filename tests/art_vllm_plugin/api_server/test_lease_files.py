"""Where exact leases keep their copies (`api_server/leases.py`): a server-private directory
(0700) holding one 0700 directory per copy with 0600 files, gone once the lease is released;
and a committed version whose file now leads out of the roots is refused (403 naming the
file) without being read. On the shared `keyed` server (its capacity allows one lease)."""

from __future__ import annotations

import os
import shutil
import stat
import time
from pathlib import Path

import httpx
import pytest
from support.server_kinds import KEYED_API_KEY as KEY

from art_vllm_plugin.adapters import CONFIG_FILE, WEIGHTS_FILE

AUTH = {"Authorization": f"Bearer {KEY}"}
#: Ceiling for a released copy's directory to go (not a timed assertion).
REMOVAL_CEILING_S = 60.0


@pytest.fixture(scope="module")
def server(keyed_server):
    """The shared `keyed` server: `--api-key`, adapter root `<root>/allowed` (where `scratch`
    lies), `<root>/outside` outside it, `--max-cpu-loras 3` (two slots and one lease)."""
    return keyed_server


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def _copy_dir(server, model: str) -> Path:
    """The lease copy vLLM loads `model` from (its card's `root` in `/v1/models`)."""
    cards = httpx.get(server.url + "/v1/models", headers=AUTH, timeout=60).json()["data"]
    (card,) = [c for c in cards if c["id"] == model]
    return Path(card["root"])


def test_a_lease_copy_is_private_and_goes_with_the_lease(server):
    version = server.start_versions["policy"]
    resp = httpx.post(
        server.url + "/art/v1/leases",
        json={"slot": "policy", "version": version, "ttl_s": 600},
        headers=AUTH,
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    lease = resp.json()
    try:
        copy = _copy_dir(server, lease["model"])
        assert copy.parent.name.startswith("art-leases-")
        assert _mode(copy.parent) == 0o700, oct(_mode(copy.parent))
        assert _mode(copy) == 0o700, oct(_mode(copy))
        files = {p.name: p for p in copy.iterdir()}
        assert set(files) == {CONFIG_FILE, WEIGHTS_FILE}
        for path in files.values():
            assert stat.S_ISREG(path.lstat().st_mode)
            assert _mode(path) == 0o600, (path, oct(_mode(path)))
    finally:
        httpx.delete(f"{server.url}/art/v1/leases/{lease['id']}", headers=AUTH, timeout=60)
    deadline = time.monotonic() + REMOVAL_CEILING_S
    while copy.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not copy.exists()


def test_a_version_whose_file_now_links_out_of_the_roots_is_403(server, tiny_adapters):
    """Committed from a plain directory, then its weights replaced by a link to a file outside
    every root: a lease of that version is refused before the file is opened."""
    adapter = shutil.copytree(tiny_adapters / "b", server.scratch / "v")
    slots = httpx.get(server.url + "/art/v1/slots", headers=AUTH, timeout=60).json()
    version = {s["slot"]: s["version"] for s in slots}["policy"] + 1
    resp = httpx.post(
        server.url + "/art/v1/lora/update",
        json={"slot": "policy", "path": str(adapter), "version": version},
        headers=AUTH,
        timeout=300,
    )
    assert resp.status_code == 200, resp.text
    outside = server.paths.root / "outside" / "lease-files-b"
    shutil.copytree(tiny_adapters / "b", outside)
    (adapter / WEIGHTS_FILE).unlink()
    os.symlink(outside / WEIGHTS_FILE, adapter / WEIGHTS_FILE)
    resp = httpx.post(
        server.url + "/art/v1/leases",
        json={"slot": "policy", "version": version, "ttl_s": 60},
        headers=AUTH,
        timeout=120,
    )
    assert resp.status_code == 403, resp.text
    message = resp.json()["error"]["message"]
    assert f"adapter file {adapter.resolve() / WEIGHTS_FILE} resolves to" in message
    assert str((outside / WEIGHTS_FILE).resolve()) in message
    assert httpx.get(server.url + "/art/v1/leases", headers=AUTH, timeout=60).json() == []
