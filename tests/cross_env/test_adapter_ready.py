"""A trainer's `export_ready` versions publish to a real server with their manifest digest.

Runs under `.venv-serve`. The training side (`adapter_ready_train_side.py`, `.venv-train`)
trains a Megatron GPT with the tiny model's shape and weights for two steps and writes
versions base+1 and base+2 of slot `policy` with `export_ready` (base: the slot's version on
the shared plain plugin server when this module starts). Here each version is published to
that running server with the body `AdapterReady.update_body()` (digest included):
the server accepts it and reports the same digest. A version whose weights were changed after
its manifest was written (a torn or stale export) is refused with 422 by the digest check.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from support.vllm_server import tiny_paths

from art_protocol.digest import digest_dir

pytestmark = pytest.mark.serve

REPO = Path(__file__).resolve().parents[2]
TRAIN_PYTHON = REPO / ".venv-train" / "bin" / "python"


@pytest.fixture(scope="module")
def server(lora_server):
    """The shared plain plugin server (`lora` in tests/support/server_kinds.py)."""
    return lora_server


@pytest.fixture(scope="module")
def base(server) -> int:
    return server.start_versions["policy"]


@pytest.fixture(scope="module")
def readies(server, base):
    """The trainer's exports of versions base+1 and base+2, inside the server's allowed
    adapter roots."""
    tiny_model = tiny_paths()[0]
    assert TRAIN_PYTHON.exists(), f"{TRAIN_PYTHON} missing: run `make train-env` first"
    root = server.scratch / "ready_root"
    cmd = [
        str(TRAIN_PYTHON),
        str(REPO / "tests" / "cross_env" / "adapter_ready_train_side.py"),
        "--hf-model",
        str(tiny_model),
        "--root",
        str(root),
        "--versions",
        str(base + 1),
        str(base + 2),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root, json.loads(proc.stdout.strip().splitlines()[-1])


def update(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/art/v1/lora/update", json=body, timeout=300)


def test_export_ready_versions_publish_with_their_digest(server, readies, base):
    _, ready = readies
    assert [r["version"] for r in ready] == [base + 1, base + 2]
    for r in ready:
        assert r["digest"] == digest_dir(r["path"])
        body = {"slot": "policy", "path": r["path"], "version": r["version"], "digest": r["digest"]}
        resp = update(server, body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["digest"] == r["digest"]
    slots = httpx.get(server.url + "/art/v1/slots", timeout=60).json()
    (policy,) = [s for s in slots if s["slot"] == "policy"]
    assert (policy["version"], policy["digest"]) == (base + 2, ready[1]["digest"])


def test_weights_changed_after_the_manifest_are_refused(server, readies, base):
    root, ready = readies
    torn = root / "policy" / f"v{base + 3}"
    shutil.copytree(ready[1]["path"], torn)
    weights = torn / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one flipped bit in the last tensor's bytes
    weights.write_bytes(bytes(data))
    body = {"slot": "policy", "path": str(torn), "version": base + 3, "digest": ready[1]["digest"]}
    resp = update(server, body)
    assert resp.status_code == 422, resp.text
    assert "digest mismatch" in resp.json()["error"]["message"]
    slots = httpx.get(server.url + "/art/v1/slots", timeout=60).json()
    assert [s["version"] for s in slots if s["slot"] == "policy"] == [base + 2]
