"""`Fleet` over three real `vllm serve` replicas: publish under traffic, lose one, bring it back.

The scenario is deterministic: replica 2 is killed (its whole process group) right before
publish KILL_BEFORE, so that publish and every later one find it down; it restarts on the
same port after the last publish, at version 0, and `reconcile()` brings it current. The
fleet publishes versions base+1 ... base+N_VERSIONS of slot `policy`, `base` being the highest
version any replica starts with.

Traffic stands in for the user's load balancer: a thread sends completions round robin to
`fleet.healthy()`. Each request records the phase of the scenario when it was sent and when
it ended, so the test can say exactly which requests may fail: those to the killed replica
that ended after the kill and were sent before its quarantine. Requests to the other
replicas never fail; none goes to the killed replica while it is quarantined.

Then a push (`publish(..., push=True)`) from a directory no replica may read reaches all three
from one read, each staging in a directory of its own.

Three servers at once (about 9 GiB here) is the point of this module: replica 0 is the shared
plain plugin server (tests/support/server_kinds.py `lora`), replicas 1 and 2 are this
module's own (`--max-num-seqs 4`), since replica 2 is killed and restarted.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from support.vllm_server import restart_same_port

from art_protocol.client import Fleet, FleetConfig, Outcome, RetryPolicy, validate_spans
from art_protocol.digest import digest_dir
from art_vllm_plugin import serve_process

pytestmark = pytest.mark.serve

N_VERSIONS = 10
KILL_BEFORE = 4  # replica KILLED is stopped right before this publish
KILLED = 2
PROMPT = "the trainer publishes a new policy and every replica"
PAUSE_S = 0.1  # between traffic requests: steady traffic that leaves the 2 cores some room
#: Between traffic requests while the killed replica restarts: nothing the fleet does changes
#: until `reconcile()` (the replica stays quarantined), and the restart (a vLLM start, minutes
#: on a loaded host) should not compete with hundreds of identical requests.
RESTART_PAUSE_S = 1.0
RETRY = RetryPolicy(
    deadline_s=180.0, attempt_timeout_s=120.0, backoff_initial_s=0.1, max_attempts=4
)


def _worker_cpu(replica: int) -> str:
    """The core replica `replica`'s worker runs on. vLLM binds a worker's OpenMP threads to the
    first core by default, where the shared replica 0 runs; the killed replica gets the other
    core, so its restart (importing vLLM in its worker) does not queue behind two workers
    that serve the traffic."""
    cpus = sorted(os.sched_getaffinity(0))
    return str(cpus[-1] if replica == KILLED else cpus[0])


def _config(tiny_model, tiny_adapters, log_path, replica: int) -> serve_process.ServeConfig:
    staging = log_path.with_name(f"staging-{replica}")  # each replica stages in its own
    staging.mkdir(exist_ok=True)
    return serve_process.ServeConfig(
        model=str(tiny_model),
        args=(
            *serve_process.tiny_lora_args(),
            *serve_process.ALLOW_UNAUTHENTICATED,  # the fleet publishes without a key
            "--max-num-seqs",
            "4",
            "--lora-modules",
            f"policy={tiny_adapters / 'a'}",
        ),
        env={"VLLM_CPU_OMP_THREADS_BIND": _worker_cpu(replica), "ART_STAGING_DIR": str(staging)},
        log_path=log_path,
        # Three servers, traffic and a restart share 2 cores (and the other jobs of a shared
        # host): start-up has taken over 300 s here. A ceiling, not a timed assertion.
        startup_timeout_s=900.0,
    )


@pytest.fixture(scope="module")
def replicas(lora_server, tiny_model, tiny_adapters, server_log):
    """Replica 0: the shared plain plugin server (never stopped here). Replicas 1 and 2: two
    servers of this module's own, started at once: the test kills replica KILLED and restarts
    it on its port, which no shared server may go through. A list the test may replace an
    entry of (restart)."""
    configs = [
        _config(tiny_model, tiny_adapters, server_log.with_name(f"{server_log.stem}-{i}.log"), i)
        for i in (1, 2)
    ]
    with ThreadPoolExecutor(len(configs)) as pool:
        futures = [pool.submit(serve_process.start, c) for c in configs]
    started, errors = [], []
    for f in futures:
        try:
            started.append(f.result())
        except Exception as exc:
            errors.append(exc)
    if errors:
        for s in started:
            s.stop()
        raise errors[0]
    replicas = [lora_server, *started]
    try:
        yield replicas
    finally:
        for s in replicas[1:]:
            s.stop()


def complete(url: str, max_tokens: int = 8) -> dict:
    body = {
        "model": "policy",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    resp = httpx.post(url + "/v1/completions", json=body, timeout=300)
    resp.raise_for_status()
    return resp.json()


def _policy_version(url: str) -> int:
    slots = httpx.get(url + "/art/v1/slots", timeout=60).json()
    return {s["slot"]: s["version"] for s in slots}["policy"]


def served_versions(url: str, latest: int) -> set[int]:
    """Versions in the spans of one new request to `url` (spans validated)."""
    choice = complete(url)["choices"][0]
    spans = validate_spans(choice, len(choice["token_ids"]), latest_version={"policy": latest})
    return {s["version"] for s in spans}


@dataclass
class Sent:
    url: str
    sent_phase: str
    ended_phase: str
    error: str | None


class Traffic:
    """Completions in a loop to `fleet.healthy()`, round robin, recording every request."""

    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        self.phase = "before-kill"
        self.latest = 0  # highest version a publish has started: no span may be newer
        self.pause_s = PAUSE_S
        self.records: list[Sent] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="fleet-traffic", daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=600)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            phase = self.phase  # read before healthy(): see the module docstring
            urls = self.fleet.healthy()
            url = urls[i % len(urls)]
            i += 1
            error = None
            try:
                choice = complete(url)["choices"][0]
                validate_spans(choice, len(choice["token_ids"]), {"policy": self.latest})
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
            with self._lock:
                self.records.append(Sent(url, phase, self.phase, error))
            self._stop.wait(self.pause_s)

    def sent(self) -> list[Sent]:
        with self._lock:
            return list(self.records)


def test_fleet_publishes_quarantines_and_reconciles(replicas, tiny_adapters):
    urls = [s.url for s in replicas]
    base = max(_policy_version(url) for url in urls)
    killed = urls[KILLED]
    others = [u for u in urls if u != killed]
    adapters = [tiny_adapters / "a", tiny_adapters / "b"]
    digests = {p: digest_dir(p) for p in adapters}

    with Fleet(urls, config=FleetConfig(retry=RETRY)) as fleet, Traffic(fleet) as traffic:
        for k in range(1, N_VERSIONS + 1):
            version = base + k
            if k == KILL_BEFORE:
                traffic.phase = "killed"
                replicas[KILLED].stop()
            adapter = adapters[k % 2]
            traffic.latest = version
            res = fleet.publish("policy", str(adapter), version, digest=digests[adapter])
            by_url = res.by_url()
            if k < KILL_BEFORE:
                assert res.ok, [r.error for r in res.failed]
                assert fleet.healthy() == urls
            else:
                assert [by_url[u].outcome for u in others] == [Outcome.APPLIED] * 2, res.failed
                dead = by_url[killed]
                assert dead.outcome is Outcome.FAILED and "ConnectError" in dead.error
                # Quarantined: one try per publish, not the whole backoff schedule again.
                expected_tries = RETRY.max_attempts if k == KILL_BEFORE else 1
                assert dead.attempts == expected_tries
                assert fleet.healthy() == others
                assert killed in fleet.quarantined()
                traffic.phase = "quarantined"
            assert fleet.targets() == {"policy": version}
            for url in fleet.healthy():  # new requests run the new version everywhere
                assert served_versions(url, version) == {version}

        # The replica comes back on the same address, at version 0: behind, still quarantined.
        traffic.phase = "restarted"
        traffic.pause_s = RESTART_PAUSE_S
        replicas[KILLED] = restart_same_port(replicas[KILLED])
        traffic.pause_s = PAUSE_S
        view = fleet.slots()["policy"]
        last_version = base + N_VERSIONS
        assert dict(view.versions) == {urls[0]: last_version, urls[1]: last_version, killed: 0}
        assert not view.agreed and view.behind == [killed]
        assert fleet.healthy() == others

        rec = fleet.reconcile()
        assert rec.ok, rec.quarantined
        assert [(r.url, r.version, r.outcome) for r in rec.updates] == [
            (killed, last_version, Outcome.APPLIED)
        ]
        assert fleet.healthy() == urls
        traffic.phase = "reconciled"
        view = fleet.slots()["policy"]
        assert view.agreed and set(view.versions.values()) == {last_version}
        last = adapters[N_VERSIONS % 2]
        for url in urls:
            # Every replica shows the published bytes: a version is current with its digest.
            assert view.digests[url] == digests[last] == view.target_digest
            assert served_versions(url, last_version) == {last_version}
        # A second reconcile finds nothing to do.
        assert fleet.reconcile().updates == ()

    sent = traffic.sent()
    failed = [r for r in sent if r.error]
    assert all(
        r.url == killed
        and r.sent_phase in ("before-kill", "killed")
        and r.ended_phase != "before-kill"
        for r in failed
    ), failed
    assert not [r for r in sent if r.url in others and r.error]
    assert not [r for r in sent if r.url == killed and r.sent_phase in ("quarantined", "restarted")]
    for url in others:
        assert any(r.url == url and r.sent_phase == "quarantined" for r in sent)


def test_a_push_reaches_every_replica_from_one_read(replicas, tiny_adapters, tmp_path):
    """The trainer's directory is on no replica's adapter root (as on another machine): the
    fleet reads it once and pushes the same bytes, digest and operation id to all three, each
    of which stages in its own directory (replica 0 in /dev/shm, 1 and 2 in their own
    `ART_STAGING_DIR`) and leaves nothing there."""
    urls = [s.url for s in replicas]
    trainer = tmp_path / "trainer" / "policy-v"
    trainer.mkdir(parents=True)
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        (trainer / f).write_bytes((tiny_adapters / "b" / f).read_bytes())
    version = max(_policy_version(url) for url in urls) + 1
    with Fleet(urls, config=FleetConfig(retry=RETRY)) as fleet:
        res = fleet.publish("policy", trainer, version, push=True)
    assert res.ok, [r.error for r in res.failed]
    digest = digest_dir(trainer)
    for r in res.replicas:
        assert r.response["operation_id"] == res.operation_id
        assert (r.response["version"], r.response["digest"]) == (version, digest)
        assert served_versions(r.url, version) == {version}
    for replica in replicas[1:]:
        staging = replica.config.env["ART_STAGING_DIR"]
        assert os.listdir(staging) == [], f"a stage was left in {staging}"
