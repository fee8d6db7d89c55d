"""LoRA slot updates whose adapter the trainer streams (`transfer`: no files, no HTTP body).

The server: the shared `dp2` server (two DP engines of one worker each, `art_nixl`, slots
`policy` (adapter a) and `ref_b` (adapter b)). The test process is the trainer:
`NixlWeightSender.send_adapter` streams the adapter's tensors over the group every worker of
both engines joined, with only `adapter_config.json` in the request
(`art_protocol.adapter_stream`); the server has it received, validated and published as a
push (`api_server/adapter_stream.py`).

Checked:
- adapter b streamed into `policy` in the middle of a generation on engine 0: the tokens before
  the update are a's greedy tokens, the spans switch version at the update's step, both
  engines commit (a receipt each), the digest is that of the two files as the protocol writes
  them, and `policy` then gives b's greedy tokens on both engines (the weights are exactly b's:
  `ref_b` serves b from its files);
- an exact lease of the streamed version serves it after the slot moved on (the version's
  files are the server's own copy: the trainer's tensors were never files);
- a plan or config that does not fit the slot (422) and a stale version (409) are refused
  before a byte moves, and the group carries the next stream;
- a retried operation id is answered from the first answer (`replayed`) before a byte
  moves, and the id with another body is refused (409);
- a stream with a NaN is refused (422) once it arrived; the slot keeps its version.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from support.adapter_stream import LONG, STEPS_BEFORE_UPDATE, Adapter, stream, stream_mid_generation
from support.greedy import PROMPT

from art_megatron_ext.weights import NixlWeightSender
from art_protocol.client import ArtClient, ArtError

pytestmark = pytest.mark.serve

#: Workers of the dp2 server: two engines of one worker each.
WORKERS = 2
#: The trainer's buckets: small, so an adapter's tensors cross bucket boundaries.
BUCKET_BYTES = 16 * 1024
SHORT = 12


@pytest.fixture(scope="module")
def server(dp2_server):
    return dp2_server


@pytest.fixture(scope="module")
def sender(server):
    """The trainer's end; every worker of both engines joined it."""
    client = ArtClient(server.url, timeout=600)
    sender = NixlWeightSender.connect(
        client, workers=WORKERS, bucket_bytes=BUCKET_BYTES, timeout_s=120
    )
    yield sender
    sender.close()
    client.close()


def complete(url: str, model: str, engine: int = 0, max_tokens: int = SHORT) -> dict:
    resp = httpx.post(
        url + "/v1/completions",
        json={
            "model": model,
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
        headers={"X-data-parallel-rank": str(engine)},
        timeout=300,
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def policy_version(server) -> int:
    slots = httpx.get(server.url + "/art/v1/slots", timeout=60).json()
    return next(s["version"] for s in slots if s["slot"] == "policy")


@pytest.fixture(scope="module")
def adapters(tiny_adapters):
    return {name: Adapter(tiny_adapters / name) for name in ("a", "b")}


def test_a_streamed_adapter_mid_generation_switches_both_engines(server, sender, adapters):
    start = policy_version(server)
    a_tokens = complete(server.url, "policy", max_tokens=LONG)["token_ids"]
    b_tokens = complete(server.url, "ref_b", max_tokens=LONG)["token_ids"]
    assert a_tokens != b_tokens
    version = start + 1
    choice, upd, k = stream_mid_generation(
        server.url,
        lambda: stream(sender, "policy", version, adapters["b"]),
        headers={"X-data-parallel-rank": "0"},
    )
    assert STEPS_BEFORE_UPDATE <= k < LONG
    assert choice["policy_spans"] == [
        {"start": 0, "end": k, "slot": "policy", "version": start},
        {"start": k, "end": LONG, "slot": "policy", "version": version},
    ]
    assert choice["token_ids"][:k] == a_tokens[:k]
    assert upd["version"] == version and upd["previous_version"] == start
    assert upd["digest"] == adapters["b"].digest()
    assert sorted(r["engine"] for r in upd["receipts"]) == [0, 1]
    for engine in (0, 1):
        assert complete(server.url, "policy", engine, LONG)["token_ids"] == b_tokens


def test_an_exact_lease_serves_a_streamed_version_after_the_slot_moved_on(server, sender, adapters):
    v = policy_version(server) + 1
    assert stream(sender, "policy", v, adapters["b"])["version"] == v
    b_tokens = complete(server.url, "ref_b")["token_ids"]
    lease = httpx.post(
        server.url + "/art/v1/leases",
        json={"slot": "policy", "version": v, "ttl_s": 600},
        timeout=60,
    )
    assert lease.status_code == 200, lease.text
    try:
        assert stream(sender, "policy", v + 1, adapters["a"])["version"] == v + 1
        leased = complete(server.url, f"policy@{v}")
        assert leased["token_ids"] == b_tokens
        assert {(s["slot"], s["version"]) for s in leased["policy_spans"]} == {(f"policy@{v}", v)}
        assert complete(server.url, "policy")["token_ids"] != b_tokens
    finally:
        httpx.delete(f"{server.url}/art/v1/leases/{lease.json()['id']}", timeout=60)


def test_what_does_not_fit_the_slot_is_refused_before_a_byte_moves(server, sender, adapters):
    before = policy_version(server)
    tokens = complete(server.url, "policy")["token_ids"]
    b = adapters["b"]
    name = next(n for n in sorted(b.tensors) if "lora_A" in n)
    wrong = [(n, d, (s[0] + 1, s[1]) if n == name else s) for n, d, s in b.plan()]
    with pytest.raises(ArtError) as shape:
        stream(sender, "policy", before + 1, b, plan=wrong)
    assert shape.value.status == 422 and name in shape.value.message
    assert "nothing was sent" in shape.value.message
    other = Adapter.__new__(Adapter)
    other.config = {**b.config, "target_modules": ["q_proj"]}
    other.tensors = b.tensors
    with pytest.raises(ArtError) as targets:
        stream(sender, "policy", before + 1, other)
    assert targets.value.status == 422 and "target_modules" in targets.value.message
    with pytest.raises(ArtError) as stale:
        stream(sender, "policy", before, b)
    assert stale.value.status == 409 and "not newer" in stale.value.message
    assert policy_version(server) == before
    assert complete(server.url, "policy")["token_ids"] == tokens
    # the group is untouched: the next stream goes through
    assert stream(sender, "policy", before + 1, b)["version"] == before + 1


def test_a_retried_stream_is_answered_from_its_record_before_a_byte_moves(server, sender, adapters):
    """The same `operation_id` after its answer was lost: the first answer, `replayed`, and
    the producer is never called; the id with another body is refused (409), nothing sent."""
    b = adapters["b"]
    v = policy_version(server) + 1
    op = f"lora-stream-retry-{v}"
    first = stream(sender, "policy", v, b, operation_id=op)
    produced = []
    again = sender.send_adapter("policy", v, b.config, b.plan(), produced.append, operation_id=op)
    assert again["replayed"] is True and not produced
    assert {k: again[k] for k in ("version", "digest", "step")} == {
        k: first[k] for k in ("version", "digest", "step")
    }
    a = adapters["a"]
    with pytest.raises(ArtError) as reused:
        sender.send_adapter("policy", v + 1, a.config, a.plan(), produced.append, operation_id=op)
    assert reused.value.status == 409 and "different body" in reused.value.message
    assert not produced and policy_version(server) == v


def test_a_stream_with_a_nan_is_refused_once_it_arrived(server, sender, adapters):
    before = policy_version(server)
    tokens = complete(server.url, "policy")["token_ids"]
    bad = Adapter.__new__(Adapter)
    bad.config = adapters["b"].config
    bad.tensors = dict(adapters["b"].tensors)
    name = sorted(bad.tensors)[0]
    bad.tensors[name] = bad.tensors[name].clone()
    bad.tensors[name].view(-1)[0] = float("nan")
    assert not bool(torch.isfinite(bad.tensors[name]).all())
    with pytest.raises(ArtError) as nan:
        stream(sender, "policy", before + 1, bad)
    assert nan.value.status == 422 and name in nan.value.message
    assert policy_version(server) == before
    assert complete(server.url, "policy")["token_ids"] == tokens
