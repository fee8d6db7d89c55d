"""`Fleet` counts a replica as holding a version only with that version's digest.

A version names one set of weights. The fleet therefore always knows the digest of what it
publishes (given, or computed here from the local adapter directory) and compares it with what
each replica reports: a replica at the version with another digest, or with none (a server
that cannot show what it holds), is not "same content", neither when it answers 409 to a
publish nor when `slots()` surveys the fleet.

The replicas here are small HTTP stand-ins on loopback that speak the two routes the fleet
uses (`POST /art/v1/lora/update`, `GET /art/v1/slots`): a real plugin server always reports a
digest, and the point is a replica that does not (an older server, a proxy that drops the
field). The fleet against real servers is tested in `tests/art_vllm_plugin/test_fleet.py`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from art_protocol.client import Fleet, FleetConfig, Outcome, RetryPolicy
from art_protocol.digest import digest_dir

FAST = RetryPolicy(deadline_s=30.0, backoff_initial_s=0.01, backoff_max_s=0.05, max_attempts=2)
OTHER_DIGEST = "xxh3-128:" + "e" * 32


class Replica:
    """What one stand-in replica answers; `posted` holds every update body it received."""

    def __init__(self, update_status: int = 200):
        self.update_status = update_status
        self.slots: dict[str, dict] = {}  # slot -> {"version", optional "digest"}
        self.posted: list[dict] = []
        self.report_digest = True
        self.url = ""

    def answer_update(self, body: dict) -> tuple[int, dict]:
        self.posted.append(body)
        slot = self.slots.setdefault(body["slot"], {"version": 0, "digest": None})
        if self.update_status == 409:
            return 409, {
                "error": {"message": f"version {body['version']} is not newer", "code": 409}
            }
        previous = slot["version"]
        slot.update(version=body["version"], digest=body.get("digest"))
        return 200, {"slot": body["slot"], "version": body["version"], "previous_version": previous}

    def answer_slots(self) -> list[dict]:
        out = []
        for name, s in self.slots.items():
            entry = {"slot": name, "version": s["version"]}
            if self.report_digest:
                entry["digest"] = s["digest"]
            out.append(entry)
        return out


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
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self._send(*replica.answer_update(body))

        def do_GET(self):
            self._send(200, replica.answer_slots())

        def log_message(self, *args):  # quiet
            pass

    return Handler


def fleet_of(*rs: Replica) -> Fleet:
    return Fleet([r.url for r in rs], config=FleetConfig(retry=FAST))


@contextmanager
def replicas(*configs: Replica) -> Iterator[list[Replica]]:
    servers = []
    try:
        for replica in configs:
            server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(replica))
            threading.Thread(target=server.serve_forever, daemon=True).start()
            replica.url = f"http://127.0.0.1:{server.server_address[1]}"
            servers.append(server)
        yield list(configs)
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


@pytest.fixture
def adapter(tmp_path) -> Path:
    """An adapter directory this process can read (the fleet digests it)."""
    path = tmp_path / "v1"
    path.mkdir()
    (path / "adapter_config.json").write_text('{"r": 8}')
    (path / "adapter_model.safetensors").write_bytes(b"weights of version 1")
    return path


def test_publish_sends_the_digest_of_the_local_adapter_when_none_is_given(adapter):
    with replicas(Replica()) as (r,), fleet_of(r) as fleet:
        res = fleet.publish("policy", str(adapter), 1)
        assert res.ok, res.failed
    assert [b["digest"] for b in r.posted] == [digest_dir(adapter)]


def test_a_path_not_readable_here_needs_a_digest_and_nothing_is_sent(tmp_path):
    missing = tmp_path / "on-the-trainer-only"
    with replicas(Replica()) as (r,), fleet_of(r) as fleet:
        with pytest.raises(ValueError, match="digest=") as err:
            fleet.publish("policy", str(missing), 1)
        assert str(missing) in str(err.value) and "policy@1" in str(err.value)
        assert fleet.healthy() == [r.url]
        given = fleet.publish("policy", str(missing), 1, digest=OTHER_DIGEST)
        assert given.ok, given.failed
    assert [b["digest"] for b in r.posted] == [OTHER_DIGEST]


def test_a_409_from_a_replica_reporting_no_digest_is_a_refusal(adapter):
    """The replica says it is at the version already, but cannot show which bytes it holds:
    it is not counted as up to date (before: `already_applied`, and healthy)."""
    fresh, silent = Replica(), Replica(update_status=409)
    silent.slots["policy"] = {"version": 1, "digest": None}
    silent.report_digest = False
    with replicas(fresh, silent), fleet_of(fresh, silent) as f:
        res = f.publish("policy", str(adapter), 1)
        by_url = res.by_url()
        assert by_url[fresh.url].outcome is Outcome.APPLIED
        r = by_url[silent.url]
        assert r.outcome is Outcome.REFUSED and not r.ok and not res.ok
        assert "digest None" in r.error and digest_dir(adapter) in r.error
        assert f.healthy() == [fresh.url]
        assert silent.url in f.quarantined()


def test_a_409_from_a_replica_with_another_digest_is_a_refusal(adapter):
    fresh, other = Replica(), Replica(update_status=409)
    other.slots["policy"] = {"version": 1, "digest": OTHER_DIGEST}
    with replicas(fresh, other), fleet_of(fresh, other) as f:
        r = f.publish("policy", str(adapter), 1).by_url()[other.url]
        assert r.outcome is Outcome.REFUSED and OTHER_DIGEST in r.error
        assert f.healthy() == [fresh.url]


def test_a_409_from_a_replica_with_the_same_digest_is_already_applied(adapter):
    fresh, there = Replica(), Replica(update_status=409)
    there.slots["policy"] = {"version": 1, "digest": digest_dir(adapter)}
    with replicas(fresh, there), fleet_of(fresh, there) as f:
        res = f.publish("policy", str(adapter), 1)
        assert res.by_url()[there.url].outcome is Outcome.ALREADY_APPLIED and res.ok
        assert f.healthy() == [fresh.url, there.url]


def test_slots_counts_a_replica_without_digest_as_behind(adapter):
    """Both replicas applied; one then reports the version but no digest."""
    a, b = Replica(), Replica()
    with replicas(a, b), fleet_of(a, b) as fleet:
        assert fleet.publish("policy", str(adapter), 1).ok
        b.report_digest = False
        view = fleet.slots()["policy"]
        assert dict(view.versions) == {a.url: 1, b.url: 1}
        assert view.target_digest == digest_dir(adapter)
        assert view.behind == [b.url] and not view.agreed
        assert fleet.healthy() == [a.url]
        assert "digest None" in fleet.quarantined()[b.url]
        # Reporting the digest again is not enough by itself: reconcile checks and releases.
        b.report_digest = True
        rec = fleet.reconcile()
        assert rec.ok and rec.updates == () and fleet.healthy() == [a.url, b.url]
