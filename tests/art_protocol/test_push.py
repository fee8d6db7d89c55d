"""Pushing an adapter's bytes from the light client (`art_protocol.push`,
`ArtClient.update_from_dir`, `Fleet.publish(..., push=True)`), without vLLM or torch: runs in
both environments.

The replicas are small HTTP stand-ins on loopback that record each multipart body they get
(split here by its boundary, byte for byte) and answer as a server that applied it. What a
real server does with a push is tested in `tests/art_vllm_plugin/api_server/test_adapter_push.py`.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from art_protocol import push
from art_protocol.client import ArtClient, Fleet, FleetConfig, Outcome, RetryPolicy
from art_protocol.digest import digest_dir
from art_protocol.push import AdapterBytes, multipart_files
from art_protocol.updates import UpdateRequest, UpdateRequestError

FAST = RetryPolicy(deadline_s=30.0, backoff_initial_s=0.01, backoff_max_s=0.05, max_attempts=2)


def split_multipart(body: bytes, content_type: str) -> dict[str, list[bytes]]:
    """part name -> the bytes of each part of that name, as sent."""
    boundary = content_type.split("boundary=", 1)[1].strip('"').encode()
    parts: dict[str, list[bytes]] = {}
    chunks = body.split(b"--" + boundary)
    assert chunks[-1].startswith(b"--"), "no closing boundary"
    for chunk in chunks[1:-1]:
        head, _, data = chunk.removeprefix(b"\r\n").partition(b"\r\n\r\n")
        name = re.search(rb'name="([^"]+)"', head).group(1).decode()
        parts.setdefault(name, []).append(data.removesuffix(b"\r\n"))
    return parts


class Replica:
    """Records each push (its parts) and reports the pushed version with its digest."""

    def __init__(self):
        self.pushes: list[dict[str, list[bytes]]] = []
        self.slots: dict[str, dict] = {}
        self.url = ""

    def answer_update(self, parts) -> tuple[int, dict]:
        self.pushes.append(parts)
        request = json.loads(parts["request"][0])
        config, weights = parts["adapter_config.json"][0], parts["adapter_model.safetensors"][0]
        digest = AdapterBytes(config, weights, "").digest()
        previous = self.slots.get(request["slot"], {}).get("version", 0)
        self.slots[request["slot"]] = {"version": request["version"], "digest": digest}
        return 200, {
            "slot": request["slot"],
            "version": request["version"],
            "previous_version": previous,
            "digest": digest,
            "operation_id": request.get("operation_id"),
        }


def _handler(replica: Replica):
    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, payload) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            assert self.headers["Content-Type"].startswith("multipart/form-data")
            self._send(*replica.answer_update(split_multipart(body, self.headers["Content-Type"])))

        def do_GET(self):
            self._send(200, [{"slot": s, **v} for s, v in replica.slots.items()])

        def log_message(self, *args) -> None:
            pass

    return Handler


@contextmanager
def replicas(n: int) -> Iterator[list[Replica]]:
    servers, out = [], []
    try:
        for _ in range(n):
            replica = Replica()
            server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(replica))
            threading.Thread(target=server.serve_forever, daemon=True).start()
            replica.url = f"http://127.0.0.1:{server.server_address[1]}"
            servers.append(server)
            out.append(replica)
        yield out
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


@pytest.fixture
def adapter_dir(tmp_path) -> Path:
    path = tmp_path / "trainer" / "v3"
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_bytes(b'{"r": 8, "target_modules": ["q_proj"]}')
    (path / "adapter_model.safetensors").write_bytes(os.urandom(4096) + b"\r\n--\r\n")
    return path


def test_update_from_dir_sends_the_request_without_a_path_and_the_files_as_read(adapter_dir):
    with replicas(1) as (replica,), ArtClient(replica.url) as art:
        answer = art.update_from_dir("policy", adapter_dir, 3, operation_id="op-1", digest=None)
    assert answer["version"] == 3
    (parts,) = replica.pushes
    assert sorted(parts) == ["adapter_config.json", "adapter_model.safetensors", "request"]
    assert json.loads(parts["request"][0]) == {
        "slot": "policy",
        "version": 3,
        "operation_id": "op-1",
    }
    for name in push.FILE_PARTS:
        assert parts[name] == [(adapter_dir / name).read_bytes()]


def test_an_unreadable_directory_is_refused_before_anything_is_sent(adapter_dir):
    (adapter_dir / "adapter_model.safetensors").unlink()
    with replicas(1) as (replica,), ArtClient(replica.url) as art:
        with pytest.raises(ValueError, match=r"adapter_model\.safetensors is not readable"):
            art.update_from_dir("policy", adapter_dir, 3)
        with pytest.raises(UpdateRequestError, match="'version'"):
            art.update_from_dir("policy", adapter_dir.parent, -1)
    assert replica.pushes == []


def test_a_push_request_names_no_path_and_replays_by_content():
    body = {"slot": "policy", "version": 3, "digest": "xxh3-128:" + "0" * 32}
    request = UpdateRequest.from_push_json(body)
    assert request.path is None and request.to_json() == body
    with pytest.raises(UpdateRequestError, match="'path' must not be given in a push"):
        UpdateRequest.from_push_json({**body, "path": "/a"})
    with pytest.raises(UpdateRequestError, match="'request' part must be a JSON object"):
        UpdateRequest.from_push_json([1])
    with pytest.raises(UpdateRequestError, match="'path'"):  # a JSON update still needs one
        UpdateRequest.from_json({"slot": "policy", "version": 3})
    assert request.fingerprint("xxh3-128:a") != request.fingerprint("xxh3-128:b")
    with pytest.raises(ValueError, match="not a path"):
        multipart_files(UpdateRequest("policy", "/a", 3), AdapterBytes(b"", b"", "x"))


def test_fleet_push_reads_once_and_sends_the_same_bytes_and_operation_id_to_every_replica(
    adapter_dir, monkeypatch
):
    reads = []
    original = AdapterBytes.read.__func__

    def counting(cls, local_dir):
        reads.append(Path(local_dir))
        return original(cls, local_dir)

    monkeypatch.setattr(AdapterBytes, "read", classmethod(counting))
    with replicas(3) as reps, Fleet([r.url for r in reps], config=FleetConfig(retry=FAST)) as fleet:
        result = fleet.publish("policy", adapter_dir, 3, push=True)
        assert result.ok, [r.error for r in result.replicas]
        assert reads == [adapter_dir]
        bodies = [r.pushes[0] for r in reps]
        assert all(b == bodies[0] for b in bodies), "replicas got different bodies"
        request = json.loads(bodies[0]["request"][0])
        assert request == {
            "slot": "policy",
            "version": 3,
            "operation_id": result.operation_id,
            "digest": digest_dir(adapter_dir),
        }
        assert fleet.healthy() == [r.url for r in reps]


def test_reconcile_pushes_a_pushed_target_again_checked_against_its_digest(adapter_dir):
    with replicas(2) as reps, Fleet([r.url for r in reps], config=FleetConfig(retry=FAST)) as fleet:
        assert fleet.publish("policy", adapter_dir, 3, push=True).ok
        reps[1].slots.clear()  # restarted at version 0
        repaired = fleet.reconcile()
        assert repaired.ok and [u.outcome for u in repaired.updates] == [Outcome.APPLIED]
        again = json.loads(reps[1].pushes[-1]["request"][0])
        assert again["version"] == 3 and again["operation_id"].startswith("fleet-reconcile-")
        assert (
            reps[1].pushes[-1]["adapter_model.safetensors"]
            == reps[0].pushes[0]["adapter_model.safetensors"]
        )
        # The trainer rewrote the directory: the target's bytes are gone, nothing is sent.
        published = digest_dir(adapter_dir)
        (adapter_dir / "adapter_model.safetensors").write_bytes(b"rewritten")
        reps[1].slots.clear()
        sent = len(reps[1].pushes)
        failed = fleet.reconcile()
        (update,) = failed.updates
        assert update.outcome is Outcome.FAILED and len(reps[1].pushes) == sent
        assert published in update.error and digest_dir(adapter_dir) in update.error
        assert reps[1].url in failed.quarantined
