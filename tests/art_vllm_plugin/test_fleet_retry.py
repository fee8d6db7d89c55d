"""`Fleet` retry, backoff, deadline and 4xx rules, against one real `vllm serve` and a closed port.

Connection errors come from a loopback port nobody listens on; a 5xx comes from the real
server's test-only fault hook (`ART_TEST_HOOKS=1`, `/art/v1/test/fault`): the next update's
commit fails on a worker after writing, every worker restores its weights, the server answers
500 and a retry with the same operation id applies. Every case happens on every run.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from art_protocol.client import ArtClient, Fleet, FleetConfig, Outcome, RetryPolicy
from art_protocol.digest import digest_dir
from art_vllm_plugin import serve_process

pytestmark = pytest.mark.serve

#: Short backoff: these tests count attempts, they do not wait for a real outage to end.
FAST = RetryPolicy(deadline_s=120.0, backoff_initial_s=0.01, backoff_max_s=0.05)
#: The digest sent with a path this process cannot read (the fleet would otherwise digest it).
SOME_DIGEST = "xxh3-128:" + "0" * 32


@pytest.fixture(scope="module")
def server(lora_server):
    """The shared plain plugin server: slots `policy` and `other` (both handed over on adapter
    a) and the test-only fault hook (`ART_TEST_HOOKS=1`)."""
    return lora_server


@pytest.fixture(scope="module")
def art(server):
    with ArtClient(server.url, timeout=120) as client:
        yield client


def closed_url() -> str:
    """A loopback URL nobody listens on (the port was free a moment ago)."""
    return f"http://127.0.0.1:{serve_process.free_port()}"


def next_version(art, slot: str = "policy") -> int:
    return {s["slot"]: s["version"] for s in art.slots()}[slot] + 1


def test_connection_refused_is_retried_up_to_max_attempts_then_quarantined():
    url = closed_url()
    policy = RetryPolicy(deadline_s=120.0, backoff_initial_s=0.01, max_attempts=3)
    with Fleet([url], config=FleetConfig(retry=policy)) as fleet:
        res = fleet.publish("policy", "/nowhere", 1, digest=SOME_DIGEST)
        (r,) = res.replicas
        assert r.outcome is Outcome.FAILED and not res.ok
        assert r.attempts == 3
        assert r.status is None
        assert url in r.error and "ConnectError" in r.error and "attempts" in r.error
        assert fleet.healthy() == []
        assert url in fleet.quarantined()
        assert fleet.targets() == {}  # nothing applied anywhere: the target did not move


def test_deadline_stops_retries():
    url = closed_url()
    policy = RetryPolicy(deadline_s=0.3, backoff_initial_s=0.05, backoff_max_s=0.05)
    with Fleet([url], config=FleetConfig(retry=policy)) as fleet:
        (r,) = fleet.publish("policy", "/nowhere", 1, digest=SOME_DIGEST).replicas
        assert r.outcome is Outcome.FAILED
        assert r.attempts >= 1
        assert "stopped by the deadline" in r.error


def test_deadline_s_argument_overrides_the_policy():
    with Fleet([closed_url()], deadline_s=7.5, config=FleetConfig(retry=FAST)) as fleet:
        assert fleet.config.retry.deadline_s == 7.5
        assert fleet.config.retry.backoff_initial_s == FAST.backoff_initial_s


def test_fleet_imports_neither_vllm_nor_torch():
    """Trainers import the fleet in their own environment (README "Client side stays light")."""
    code = (
        "import sys, art_protocol.client.fleet; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'torch'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_backoff_grows_and_caps():
    policy = RetryPolicy(backoff_initial_s=0.5, backoff_multiplier=2.0, backoff_max_s=3.0)
    delays = policy.delays()
    assert [next(delays) for _ in range(6)] == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"deadline_s": 0}, "deadline_s"),
        ({"attempt_timeout_s": -1}, "attempt_timeout_s"),
        ({"backoff_multiplier": 0.5}, "backoff_multiplier"),
        ({"max_attempts": 0}, "max_attempts"),
    ],
)
def test_bad_retry_policy_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RetryPolicy(**kwargs)


def test_bad_arguments_are_refused_before_anything_is_sent():
    with pytest.raises(ValueError, match="at least one"):
        Fleet([])
    with pytest.raises(ValueError, match="more than once"):
        Fleet(["http://127.0.0.1:1", "http://127.0.0.1:1/"])
    with Fleet([closed_url()]) as fleet:
        with pytest.raises(ValueError, match="version"):
            fleet.publish("policy", "/x", -1)
        with pytest.raises(ValueError, match="digest"):
            fleet.publish("policy", "/x", 1, digest="md5:abc")
        assert fleet.healthy() == list(fleet.urls)  # nothing was sent, nobody quarantined


def test_5xx_is_retried_with_the_same_operation_and_applies(server, art, tiny_adapters):
    armed = httpx.post(
        server.url + "/art/v1/test/fault", json={"kind": "commit", "rank": 0}, timeout=60
    )
    assert armed.status_code == 200, armed.text
    version = next_version(art)
    b = tiny_adapters / "b"
    with Fleet([server.url], config=FleetConfig(retry=FAST)) as fleet:
        res = fleet.publish("policy", str(b), version, digest=digest_dir(b))
        (r,) = res.replicas
        assert r.outcome is Outcome.APPLIED, r.error
        assert r.attempts == 2  # the injected 500, then the retry
        assert r.status == 200 and r.response["version"] == version
        assert fleet.healthy() == [server.url]
        assert fleet.targets() == {"policy": version}
    assert next_version(art) == version + 1


def test_4xx_is_not_retried_and_does_not_quarantine(server, art, tiny_adapters):
    version = next_version(art)
    with Fleet([server.url], config=FleetConfig(retry=FAST)) as fleet:
        (r,) = fleet.publish("no-such-slot", str(tiny_adapters / "a"), version).replicas
        assert r.outcome is Outcome.REFUSED
        assert r.attempts == 1
        assert r.status == 404 and "no-such-slot" in r.error
        # Refused everywhere: the target did not move, so the replica is still current.
        assert fleet.healthy() == [server.url]
    assert next_version(art) == version


def test_repeat_of_an_operation_is_already_applied(server, art, tiny_adapters):
    """A trainer that publishes the same step twice (same operation id) changes nothing."""
    version = next_version(art)
    a = str(tiny_adapters / "a")
    with Fleet([server.url], config=FleetConfig(retry=FAST)) as fleet:
        first = fleet.publish("policy", a, version, operation_id=f"step-{version}")
        assert first.replicas[0].outcome is Outcome.APPLIED, first.replicas[0].error
        again = fleet.publish("policy", a, version, operation_id=f"step-{version}")
        (r,) = again.replicas
        assert r.outcome is Outcome.ALREADY_APPLIED, r.error
        assert r.attempts == 1
        # The server remembered the operation: the first response, marked as a replay.
        assert r.status == 200 and r.response["replayed"] is True
        assert r.response["version"] == version
        assert r.response["operation_id"] == f"step-{version}"
        assert fleet.healthy() == [server.url]
    assert next_version(art) == version + 1


def test_older_version_is_refused_once(server, art, tiny_adapters):
    current = next_version(art)
    art.update("policy", str(tiny_adapters / "b"), current)
    with Fleet([server.url], config=FleetConfig(retry=FAST)) as fleet:
        (r,) = fleet.publish("policy", str(tiny_adapters / "a"), current - 1).replicas
        assert r.outcome is Outcome.REFUSED and r.status == 409 and r.attempts == 1
        assert f"reports version {current}" in r.error
    assert next_version(art) == current + 1


def test_a_replica_that_diverged_is_noticed_and_stays_out_until_current(server, art, tiny_adapters):
    """Someone published to the replica behind the fleet's back, on two slots.

    The fleet's next publish of `policy` sees `previous_version` differ from its own target,
    checks every slot, and quarantines the replica for `other`; `reconcile()` cannot take
    `other` back (the replica is ahead: 409), so it stays out until the fleet publishes a
    newer `other`.
    """
    a = str(tiny_adapters / "a")
    with Fleet([server.url], config=FleetConfig(retry=FAST)) as fleet:
        p, o = next_version(art), next_version(art, "other")
        assert fleet.publish("policy", a, p).ok and fleet.publish("other", a, o).ok
        art.update("policy", a, p + 1)  # not through the fleet
        art.update("other", a, o + 1)
        res = fleet.publish("policy", a, p + 2)
        assert res.ok and res.replicas[0].response["previous_version"] == p + 1
        assert fleet.healthy() == []
        assert "'other': (" in fleet.quarantined()[server.url]

        rec = fleet.reconcile()
        (r,) = rec.updates
        assert (r.slot, r.outcome, r.status) == ("other", Outcome.REFUSED, 409)
        assert not rec.ok and fleet.healthy() == []

        assert fleet.publish("other", a, o + 2).ok
        assert fleet.healthy() == [server.url]
        view = fleet.slots()
        assert view["policy"].agreed and view["other"].agreed
