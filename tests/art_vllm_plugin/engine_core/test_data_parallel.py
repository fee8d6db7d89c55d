"""Data parallelism: `vllm serve --data-parallel-size 2` (two EngineCores, each with its own
worker, and by default two API-server processes) runs on this CPU host, so these tests use it
(the shared `dp2` server of tests/support/server_kinds.py).

- an update commits on both engines (a receipt from each) or on neither;
- requests served by either engine carry the right tokens and spans;
- a staging (prepare) failure on one engine, and a commit failure on one engine after the other
  committed, leave both engines on the old version (test-only fault hook, `ART_TEST_HOOKS=1`);
- a version engine 0 committed before reverting stays bound to its digest: the same version
  with other bytes is refused (409), the same bytes commit;
- an update left unknown on one engine blocks the slot on both (503 through both API servers)
  until a clean update;
- both API servers answer `/art/v1/slots` identically and validate aliases the same way right
  after an update returned through the other one; replay and compare-and-swap hold across them;
- an exact lease made through one API server serves, lists and releases through the other
  (leases live in engine 0's registry).

Which API server answers is the kernel's choice (they share one listening socket), so the
tests open persistent connections until they hold one to each (`api_server_clients`).
Which engine serves a request is vLLM's load balancer's choice; that both served is read from
vLLM's own per-engine Prometheus counters.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest
from support.api_server_clients import one_client_per_api_server

from art_protocol.digest import digest_dir

PROMPT = "the policy model learns from the reward and the trainer sends"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(dp2_server):
    """`--data-parallel-size 2`, slots policy (a) and ref_b (b), the test-only fault hook."""
    return dp2_server


@pytest.fixture(scope="module")
def api_servers(server):
    """Two clients, each holding one connection to a different API-server process."""
    with one_client_per_api_server(server.url) as clients:
        yield clients


@pytest.fixture(scope="module")
def refs(server):
    """Greedy tokens of adapter a (policy at start) and b (ref_b) on this server."""
    return {
        "a": complete(server.url, "policy")["token_ids"],
        "b": complete(server.url, "ref_b")["token_ids"],
    }


def complete(url: str, model: str) -> dict:
    resp = httpx.post(
        url + "/v1/completions",
        json={
            "model": model,
            "prompt": PROMPT,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
        timeout=300,
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


async def _many(url: str, model: str, n: int) -> list[httpx.Response]:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(n)))


def engine_generation_tokens(url: str) -> dict[str, float]:
    """vLLM's `vllm:generation_tokens_total` per engine label."""
    text = httpx.get(url + "/metrics", timeout=60).text
    out: dict[str, float] = {}
    for labels, value in re.findall(r"^vllm:generation_tokens_total\{([^}]*)\} (\S+)", text, re.M):
        engine = re.search(r'engine="(\d+)"', labels)
        if engine:
            out[engine[1]] = out.get(engine[1], 0.0) + float(value)
    return out


def slots(client) -> dict:
    return {s["slot"]: s for s in client.get("/art/v1/slots").json()}


def post_update(client, **body) -> httpx.Response:
    return client.post("/art/v1/lora/update", json=body)


def version(client) -> int:
    return slots(client)["policy"]["version"]


def both_engines_at(client, v: int, digest: str) -> None:
    engines = slots(client)["policy"]["engines"]
    assert engines == [
        {"engine": 0, "version": v, "digest": digest},
        {"engine": 1, "version": v, "digest": digest},
    ]


def test_update_lands_on_both_engines_with_a_receipt_from_each(api_servers, tiny_adapters):
    a, _ = api_servers
    v = version(a) + 1
    resp = post_update(a, slot="policy", path=str(tiny_adapters / "b"), version=v)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    digest = digest_dir(tiny_adapters / "b")
    assert [r["engine"] for r in body["receipts"]] == [0, 1]
    assert all(r["version"] == v and r["digest"] == digest for r in body["receipts"])
    assert body["step"] == body["receipts"][0]["step"]
    both_engines_at(a, v, digest)


def test_both_api_servers_agree_right_after_an_update(api_servers, tiny_adapters):
    a, b = api_servers
    for via, other in ((a, b), (b, a)):
        v = version(via) + 1
        resp = post_update(via, slot="policy", path=str(tiny_adapters / "a"), version=v)
        assert resp.status_code == 200, resp.text
        assert other.get("/art/v1/slots").json() == via.get("/art/v1/slots").json()
        assert slots(other)["policy"]["version"] == v
        m_via = via.get("/art/metrics").json()["slots"]["policy"]
        m_other = other.get("/art/metrics").json()["slots"]["policy"]
        assert m_via == m_other and m_other["version"] == v
        body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
        fresh = other.post("/v1/completions", json={**body, "model": f"policy@{v}"})
        assert fresh.status_code == 200, fresh.text
        stale = other.post("/v1/completions", json={**body, "model": f"policy@{v - 1}"})
        assert stale.status_code == 409, stale.text
        assert f"current is policy@{v}" in stale.text


def test_aliases_of_the_current_version_cost_no_registry_read(api_servers, tiny_adapters):
    """With two API servers an alias is checked against the registry copy cached at engine
    0's pushed registry generation: after an update and one alias request per API server,
    further alias requests read nothing from the engines (each read waits for a step). The
    slot stays on adapter a (the `refs` of later tests)."""
    a, b = api_servers
    v = version(a) + 1
    assert (
        post_update(a, slot="policy", path=str(tiny_adapters / "a"), version=v).status_code == 200
    )
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "model": f"policy@{v}"}
    for client in (a, b):
        assert client.post("/v1/completions", json=body).status_code == 200
    reads = a.get("/art/v1/engine").json()["registry_reads"]
    for _ in range(4):
        for client in (a, b):
            resp = client.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
    assert a.get("/art/v1/engine").json()["registry_reads"] == reads


def test_requests_served_by_each_engine_carry_the_new_weights_and_spans(
    server, api_servers, tiny_adapters, refs
):
    a, _ = api_servers
    assert refs["a"] != refs["b"]
    v = version(a) + 1
    assert (
        post_update(a, slot="policy", path=str(tiny_adapters / "b"), version=v).status_code == 200
    )
    before = engine_generation_tokens(server.url)
    responses = asyncio.run(_many(server.url, "policy", 8))
    after = engine_generation_tokens(server.url)
    served = {e for e in after if after[e] > before.get(e, 0.0)}
    assert served == {"0", "1"}, f"per-engine generation tokens before {before}, after {after}"
    for resp in responses:
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["token_ids"] == refs["b"]
        assert choice["policy_spans"] == [
            {"start": 0, "end": MAX_TOKENS, "slot": "policy", "version": v}
        ]


def _arm(client, kind: str, engine: int) -> None:
    resp = client.post("/art/v1/test/fault", json={"kind": kind, "rank": 0, "engine": engine})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize(("kind", "engine"), [("stage", 1), ("stage", 0), ("commit", 1)])
def test_a_failure_on_one_engine_leaves_every_engine_on_the_old_version(
    server, api_servers, tiny_adapters, refs, kind, engine
):
    """`stage`: engine `engine`'s worker fails to prepare, so no engine commits. `commit`:
    engine 1's worker fails its commit after engine 0 committed, so engine 0 reverts."""
    a, b = api_servers
    v = version(a) + 1
    assert (
        post_update(a, slot="policy", path=str(tiny_adapters / "a"), version=v).status_code == 200
    )
    digest_a = digest_dir(tiny_adapters / "a")
    _arm(a, kind, engine)
    resp = post_update(a, slot="policy", path=str(tiny_adapters / "b"), version=v + 1)
    assert resp.status_code == 500, resp.text
    msg = resp.json()["error"]["message"]
    assert f"keeps serving version {v}" in msg
    if kind == "commit":
        assert "engines [0] reverted" in msg
    for client in (a, b):
        both_engines_at(client, v, digest_a)
    for resp in asyncio.run(_many(server.url, "policy", 8)):
        choice = resp.json()["choices"][0]
        assert choice["token_ids"] == refs["a"]
        assert [s["version"] for s in choice["policy_spans"]] == [v]
    # nothing is left armed or reserved: the next update goes through everywhere
    ok = post_update(b, slot="policy", path=str(tiny_adapters / "b"), version=v + 1)
    assert ok.status_code == 200, ok.text
    both_engines_at(a, v + 1, digest_dir(tiny_adapters / "b"))


async def _race(clients, bodies):
    def one(client, body):
        return client.post("/art/v1/lora/update", json=body)

    return await asyncio.gather(
        *(asyncio.to_thread(one, c, b) for c, b in zip(clients, bodies, strict=True))
    )


def test_racing_through_both_api_servers_with_the_same_expected_version_one_wins(
    api_servers, tiny_adapters
):
    a, b = api_servers
    current = version(a)
    bodies = [
        {
            "slot": "policy",
            "path": str(tiny_adapters / name),
            "version": current + 1 + i,
            "expected_version": current,
            "operation_id": f"dp-race-{name}-{time.time_ns()}",
        }
        for i, name in enumerate(("a", "b"))
    ]
    responses = asyncio.run(_race([a, b], bodies))
    assert sorted(r.status_code for r in responses) == [200, 409], [r.text for r in responses]
    winner = next(r for r in responses if r.status_code == 200).json()
    assert version(a) == version(b) == winner["version"]
    both_engines_at(b, winner["version"], winner["digest"])


def test_an_operation_replayed_through_the_other_api_server_is_not_reapplied(
    api_servers, tiny_adapters
):
    a, b = api_servers
    body = {
        "slot": "policy",
        "path": str(tiny_adapters / "a"),
        "version": version(a) + 1,
        "operation_id": f"dp-replay-{time.time_ns()}",
    }
    first = post_update(a, **body)
    assert first.status_code == 200, first.text
    updates = slots(a)["policy"]
    again = post_update(b, **body)
    assert again.status_code == 200, again.text
    assert again.json() == {**first.json(), "replayed": True}
    assert slots(b)["policy"] == updates


def test_a_version_one_engine_committed_stays_bound_to_its_digest(api_servers, tiny_adapters):
    """Engine 0 commits v+1 (adapter b) and reverts when engine 1 fails: the slot is back on v
    and v+1 is admitted again, but tokens labelled v+1 came from b's weights on engine 0. So
    v+1 with another digest is refused (409 naming the version and both digests), through
    either API server, and v+1 with b's digest (a retry) commits."""
    a, b = api_servers
    v = version(a) + 1
    assert (
        post_update(a, slot="policy", path=str(tiny_adapters / "a"), version=v).status_code == 200
    )
    digest_a, digest_b = digest_dir(tiny_adapters / "a"), digest_dir(tiny_adapters / "b")
    _arm(a, "commit", 1)
    failed = post_update(a, slot="policy", path=str(tiny_adapters / "b"), version=v + 1)
    assert failed.status_code == 500, failed.text
    assert "engines [0] reverted" in failed.json()["error"]["message"]
    both_engines_at(a, v, digest_a)

    for client in (a, b):
        other = post_update(client, slot="policy", path=str(tiny_adapters / "a"), version=v + 1)
        assert other.status_code == 409, other.text
        msg = other.json()["error"]["message"]
        assert f"version {v + 1} of slot 'policy'" in msg and digest_b in msg and digest_a in msg
        both_engines_at(client, v, digest_a)  # refused: nothing changed anywhere

    retry = post_update(b, slot="policy", path=str(tiny_adapters / "b"), version=v + 1)
    assert retry.status_code == 200, retry.text
    both_engines_at(a, v + 1, digest_b)


def test_an_update_left_unknown_blocks_the_slot_on_every_engine_until_a_clean_update(
    server, api_servers, tiny_adapters
):
    """Engine 1 fails its commit and reports its restore failed (test hook "unknown"): 503, and
    the slot is blocked on both engines. A new request on it through either API server is
    refused with 503 naming the failed update, whichever engine gets it: the API server that
    did not run the update learns it from the engine, not from its own copy of the registry.
    The other slot keeps serving; a clean update unblocks."""
    a, b = api_servers
    v = version(a)
    op = f"dp-unknown-{time.time_ns()}"
    _arm(a, "unknown", 1)
    upd = post_update(
        a, slot="policy", path=str(tiny_adapters / "b"), version=v + 1, operation_id=op
    )
    assert upd.status_code == 503, upd.text
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    for client in (a, b):
        for _ in range(2):  # vLLM balances new requests over the engines
            resp = client.post("/v1/completions", json={**body, "model": "policy"})
            assert resp.status_code == 503, resp.text
            msg = resp.json()["error"]["message"]
            assert f"update to version {v + 1}" in msg and op in msg, msg
        assert client.post("/v1/completions", json={**body, "model": "ref_b"}).status_code == 200
        assert op in slots(client)["policy"]["blocked"]
    # Engine 0 committed v+1 with b's bytes before it reverted: v+1 stays bound to them.
    ok = post_update(b, slot="policy", path=str(tiny_adapters / "b"), version=v + 1)
    assert ok.status_code == 200, ok.text
    for client in (a, b):
        assert slots(client)["policy"]["blocked"] is None
        resp = client.post("/v1/completions", json={**body, "model": "policy"})
        assert resp.status_code == 200, resp.text


def test_a_lease_made_through_one_api_server_serves_and_releases_through_the_other(
    server, api_servers, tiny_adapters, refs
):
    """Version v (adapter b) leased through API server a, the slot moved on to adapter a:
    through b, which never saw the lease made, `policy@v` serves b's tokens labelled v, the
    lease is listed, and released; then neither API server serves `policy@v`."""
    a, b = api_servers
    v = version(a) + 1
    assert (
        post_update(a, slot="policy", path=str(tiny_adapters / "b"), version=v).status_code == 200
    )
    made = a.post("/art/v1/leases", json={"slot": "policy", "version": v, "ttl_s": 300})
    assert made.status_code == 200, made.text
    lease = made.json()
    assert lease["model"] == f"policy@{v}"
    moved = post_update(a, slot="policy", path=str(tiny_adapters / "a"), version=v + 1)
    assert moved.status_code == 200, moved.text
    body = {
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "model": f"policy@{v}",
    }
    for client in (b, a):
        for _ in range(2):  # vLLM balances new requests over the engines
            resp = client.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            choice = resp.json()["choices"][0]
            assert choice["token_ids"] == refs["b"]
            assert {s["version"] for s in choice["policy_spans"]} == {v}
    assert [x["id"] for x in b.get("/art/v1/leases").json()] == [lease["id"]]
    assert [x["id"] for x in slots(b)["policy"]["leases"]] == [lease["id"]]
    gone = b.delete(f"/art/v1/leases/{lease['id']}")
    assert gone.status_code == 200 and gone.json()["copy_removed"] is True, gone.text
    for client in (a, b):
        # a drops the copy when it next reads the registry (engine 0 pushes the new
        # generation at once; listing the leases reads it here without waiting for that)
        assert client.get("/art/v1/leases").json() == []
        refused = client.post("/v1/completions", json=body)
        assert refused.status_code == 409, refused.text
    assert complete(server.url, "policy")["token_ids"] == refs["a"]
