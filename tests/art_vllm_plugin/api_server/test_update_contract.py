"""`POST /art/v1/lora/update`'s contract on one engine: `operation_id` replay, compare-and-swap
with `expected_version`, the adapter digest, receipts, and the slot registry read from
EngineCore (`/art/v1/slots`, `/art/metrics` schema 4).

The shared plain plugin server (`policy` handed over on adapter a). "Not re-applied" is read
from EngineCore itself (`/art/v1/engine` counts the commits it made).
"""

from __future__ import annotations

import asyncio
import itertools

import httpx
import pytest
from support.adapters import copy_adapter
from support.greedy import greedy_tokens

from art_protocol.digest import digest_dir


@pytest.fixture(scope="module")
def server(lora_server):
    """The shared plain plugin server (`lora` in tests/support/server_kinds.py)."""
    return lora_server


@pytest.fixture(scope="module")
def scratch(server):
    """This module's adapters, inside the server's allowed adapter roots."""
    return server.scratch


_OPS = itertools.count()


def op_id(name: str) -> str:
    return f"{name}-{next(_OPS)}"


def update(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/art/v1/lora/update", json=body, timeout=300)


def slot(server) -> dict:
    return {s["slot"]: s for s in httpx.get(server.url + "/art/v1/slots", timeout=60).json()}[
        "policy"
    ]


def engine_updates(server) -> int:
    return httpx.get(server.url + "/art/v1/engine", timeout=60).json()["updates"]


def test_slots_carry_the_start_adapters_digest(server, tiny_adapters):
    s = slot(server)
    assert s["digest"] == digest_dir(tiny_adapters / "a")
    assert s["engines"] == [{"engine": 0, "version": s["version"], "digest": s["digest"]}]


def test_response_has_one_receipt_and_the_digest(server, tiny_adapters):
    v = slot(server)["version"] + 1
    resp = update(server, slot="policy", path=str(tiny_adapters / "b"), version=v)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    digest = digest_dir(tiny_adapters / "b")
    assert body["digest"] == digest and body["previous_version"] == v - 1
    assert body["receipts"] == [
        {"engine": 0, "step": body["step"], "version": v, "digest": digest, "workers": [0]}
    ]
    s = slot(server)
    assert (s["version"], s["digest"]) == (v, digest)
    metrics = httpx.get(server.url + "/art/metrics", timeout=60).json()
    assert metrics["schema_version"] == 4
    assert metrics["slots"]["policy"]["digest"] == digest
    assert metrics["slots"]["policy"]["version"] == v


def test_same_operation_id_and_body_returns_the_first_response_once_applied(server, tiny_adapters):
    v = slot(server)["version"] + 1
    body = {"slot": "policy", "path": str(tiny_adapters / "a"), "version": v}
    body["operation_id"] = op_id("replay")
    first = update(server, **body)
    assert first.status_code == 200, first.text
    commits = engine_updates(server)
    again = update(server, **body)
    assert again.status_code == 200, again.text
    assert again.json() == {**first.json(), "replayed": True}
    assert engine_updates(server) == commits, "a replay must not commit again"
    assert slot(server)["version"] == v


def test_same_operation_id_with_another_body_is_409(server, tiny_adapters):
    v = slot(server)["version"] + 1
    op = op_id("reuse")
    first = update(server, slot="policy", path=str(tiny_adapters / "b"), version=v, operation_id=op)
    assert first.status_code == 200, first.text
    other = update(
        server, slot="policy", path=str(tiny_adapters / "a"), version=v + 1, operation_id=op
    )
    assert other.status_code == 409, other.text
    assert op in other.text and "different body" in other.text
    assert slot(server)["version"] == v


def test_expected_version_mismatch_is_409_naming_both(server, tiny_adapters):
    current = slot(server)["version"]
    resp = update(
        server,
        slot="policy",
        path=str(tiny_adapters / "b"),
        version=current + 5,
        expected_version=current - 1,
    )
    assert resp.status_code == 409, resp.text
    msg = resp.json()["error"]["message"]
    assert f"expected_version {current - 1}" in msg and f"current version is {current}" in msg
    assert slot(server)["version"] == current
    ok = update(
        server,
        slot="policy",
        path=str(tiny_adapters / "b"),
        version=current + 1,
        expected_version=current,
    )
    assert ok.status_code == 200, ok.text


async def _race(server, bodies):
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        return await asyncio.gather(*(client.post("/art/v1/lora/update", json=b) for b in bodies))


def test_two_clients_racing_with_the_same_expected_version_exactly_one_wins(server, tiny_adapters):
    current = slot(server)["version"]
    bodies = [
        {
            "slot": "policy",
            "path": str(tiny_adapters / name),
            "version": current + 1 + i,
            "expected_version": current,
            "operation_id": op_id(f"race-{name}"),
        }
        for i, name in enumerate(("a", "b"))
    ]
    commits = engine_updates(server)
    responses = asyncio.run(_race(server, bodies))
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200, 409], [r.text for r in responses]
    winner = next(r for r in responses if r.status_code == 200).json()
    loser = next(r for r in responses if r.status_code == 409).json()
    assert f"expected_version {current}" in loser["error"]["message"]
    assert engine_updates(server) == commits + 1
    assert slot(server)["version"] == winner["version"]


def test_digest_mismatch_is_422_and_changes_nothing(server, tiny_adapters, scratch):
    before, before_tokens = slot(server), greedy_tokens(server.url)
    torn = copy_adapter(tiny_adapters / "b", scratch / "torn")
    claimed = digest_dir(tiny_adapters / "b")
    weights = torn / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # a torn copy: still a valid file, other bytes than the trainer's
    weights.write_bytes(bytes(data))
    commits = engine_updates(server)
    resp = update(
        server,
        slot="policy",
        path=str(torn),
        version=before["version"] + 1,
        digest=claimed,
        operation_id=op_id("torn"),
    )
    assert resp.status_code == 422, resp.text
    msg = resp.json()["error"]["message"]
    assert "digest mismatch" in msg and claimed in msg and digest_dir(torn) in msg
    assert slot(server) == before
    assert engine_updates(server) == commits
    assert greedy_tokens(server.url) == before_tokens
    good = update(
        server,
        slot="policy",
        path=str(tiny_adapters / "b"),
        version=before["version"] + 1,
        digest=claimed,
    )
    assert good.status_code == 200, good.text


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("digest", "md5:abc", "'digest'"),
        ("operation_id", "", "'operation_id'"),
        ("operation_id", 7, "'operation_id'"),
        ("expected_version", -1, "'expected_version'"),
        ("expected_version", True, "'expected_version'"),
    ],
)
def test_malformed_new_fields_are_400_naming_the_field(
    server, tiny_adapters, field, value, fragment
):
    before = slot(server)
    body = {"slot": "policy", "path": str(tiny_adapters / "a"), "version": 10**6, field: value}
    resp = update(server, **body)
    assert resp.status_code == 400, resp.text
    assert fragment in resp.json()["error"]["message"]
    assert slot(server) == before
