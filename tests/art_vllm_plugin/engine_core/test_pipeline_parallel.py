"""Pipeline parallelism: with `--pipeline-parallel-size 2` a commit is all or nothing over both
stages, and the engine's answer is every stage's (issue 36, item 4).

The server: the shared `pp2` server (tests/support/server_kinds.py): the tiny model in
float32 on two pipeline stages (worker 0 holds the first layer, worker 1 the last), LoRA slots
`policy` (adapter a) and `ref_b` (b), the test hooks. A fault on worker 1 is a failure on the
last stage. Before the fix the stages agreed over the tensor-parallel group only (one worker
each here) and EngineCore settled from worker 0's answer: the failed update was answered 200,
recorded as committed, and stage 0 served the new weights beside stage 1's old ones.

Checked, LoRA and full weights alike:
- an update in the middle of a generation (after STEPS_BEFORE_UPDATE engine steps) splits its
  spans once, the tokens before the split are the old weights' greedy tokens, and both
  workers committed (the receipt). Where the split falls is not `step - s0` as on one stage:
  two stages keep two batches in flight, and a request's next token needs the previous one,
  so a lone request gets a token every other scheduled batch or so;
- a commit failing on the last stage is answered 500 naming worker 1, the version does not
  move, and every stage serves the old weights (the old greedy tokens: LoRA against the
  same server's tokens before, full weights against Hugging Face's).

The full-weight tests change the base weights, so this module runs last on its server
(`changes_base_weights`).
"""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest
from support.full_weights import (
    LONG,
    SHORT,
    STEPS_BEFORE_UPDATE,
    Server,
    export,
    generate_across_update,
    hf_greedy,
    prompt_ids,
    tokens,
    update,
)
from support.step_hold import update_after_steps

from art_protocol.spans import validate_spans

pytestmark = [pytest.mark.serve, pytest.mark.changes_base_weights]

LAST_STAGE = 1


@pytest.fixture(scope="module")
def server(pp2_server, tiny_model):
    """The shared pp2 server (two pipeline stages, float32, slots policy and ref_b, the test
    hooks); this module's exports go to its scratch directory, inside an adapter root."""
    return Server(pp2_server, pp2_server.scratch, tiny_model)


def _arm_last_stage(server) -> None:
    armed = httpx.post(
        server.url + "/art/v1/test/fault", json={"kind": "commit", "rank": LAST_STAGE}, timeout=60
    )
    assert armed.status_code == 200, armed.text


def _slot_version(server, slot: str = "policy") -> int:
    slots = httpx.get(server.url + "/art/v1/slots", timeout=60).json()
    return next(s["version"] for s in slots if s["slot"] == slot)


def _lora_update(server, path, version) -> httpx.Response:
    body = {"slot": "policy", "path": str(path), "version": version}
    return httpx.post(server.url + "/art/v1/lora/update", json=body, timeout=600)


def _base_version(server) -> int:
    return httpx.get(server.url + "/art/v1/weights", timeout=60).json()["version"]


def test_a_lora_update_mid_generation_switches_both_stages_at_its_step(server, tiny_adapters):
    base = _slot_version(server)
    ref_a = tokens(server, 0, model="policy", max_tokens=LONG)
    ref_b = tokens(server, 0, model="ref_b", max_tokens=LONG)
    assert ref_a != ref_b
    body = {
        "model": "policy",
        "prompt": "the policy model learns from the reward and the trainer sends its weights",
        "max_tokens": LONG,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            return await update_after_steps(
                client,
                lambda: client.post("/v1/completions", json=body),
                STEPS_BEFORE_UPDATE,
                {"slot": "policy", "path": str(tiny_adapters / "b"), "version": base + 1},
            )

    resp, upd, _ = asyncio.run(run())
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    k = choice["policy_spans"][0]["end"]
    assert 0 < k < LONG, "the update must land mid-generation"
    assert choice["policy_spans"] == [
        {"start": 0, "end": k, "slot": "policy", "version": base},
        {"start": k, "end": LONG, "slot": "policy", "version": base + 1},
    ]
    assert choice["token_ids"][:k] == ref_a[:k]
    assert [(r["engine"], r["workers"]) for r in upd["receipts"]] == [(0, [0, 1])]
    assert tokens(server, 0, model="policy") == ref_b[:SHORT]


def test_a_lora_commit_failing_on_the_last_stage_leaves_every_stage_on_the_old_weights(
    server, tiny_adapters
):
    before = _slot_version(server)
    old = tokens(server, 0, model="policy")
    _arm_last_stage(server)
    resp = _lora_update(server, tiny_adapters / "c", before + 1)
    assert resp.status_code == 500, resp.text
    assert f"rank {LAST_STAGE}: " in resp.json()["error"]["message"]
    assert _slot_version(server) == before
    assert tokens(server, 0, model="policy") == old
    # the slot is not blocked: the next update commits on both stages
    again = _lora_update(server, tiny_adapters / "c", before + 1)
    assert again.status_code == 200, again.text
    assert again.json()["receipts"][0]["workers"] == [0, 1]


@pytest.fixture(scope="module")
def new_weights(server):
    return export(server, "new", noise=0.05)


@pytest.fixture(scope="module")
def refs(server, new_weights) -> dict[str, list[int]]:
    ids = prompt_ids(server)
    return {"old": hf_greedy(server.model, ids, LONG), "new": hf_greedy(new_weights, ids, SHORT)}


def test_a_full_weight_update_mid_generation_switches_both_stages_at_its_step(
    server, new_weights, refs
):
    start = _base_version(server)
    assert tokens(server, 0) == refs["old"][:SHORT]
    version = server.version()
    resp, upd, _ = generate_across_update(server, {"path": str(new_weights), "version": version})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    spans = validate_spans(choice, LONG, latest_version=0, latest_base_version=version)
    assert [(s["version"], s.get("base_version", 0)) for s in spans] == [(0, start), (0, version)]
    k = spans[0]["end"]
    assert 0 < k < LONG, "the update must land mid-generation"
    assert choice["token_ids"][:k] == refs["old"][:k]
    assert [(r["engine"], r["workers"]) for r in upd["receipts"]] == [(0, [0, 1])]
    assert tokens(server, 0) == refs["new"]


def test_a_base_commit_failing_on_the_last_stage_leaves_every_stage_on_the_old_weights(
    server, refs
):
    """Runs after the update above: the weights served are `new_weights`, whose greedy tokens
    Hugging Face gives."""
    before = _base_version(server)
    assert tokens(server, 0) == refs["new"]
    _arm_last_stage(server)
    bad = export(server, f"fails-{uuid.uuid4().hex[:8]}", noise=0.05, seed=before + 7)
    resp = update(server, bad, server.version())
    assert resp.status_code == 500, resp.text
    assert f"rank {LAST_STAGE}: " in resp.json()["error"]["message"]
    assert _base_version(server) == before
    assert tokens(server, 0) == refs["new"]
