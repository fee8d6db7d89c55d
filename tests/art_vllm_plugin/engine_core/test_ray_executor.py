"""vLLM's Ray executor: labels exact, with an engine's workers on two Ray nodes (issue 36,
item 6).

The server: the shared `ray_tp2` server (tests/support/server_kinds.py): the tiny model in
float32, `--distributed-executor-backend ray --tensor-parallel-size 2` on a local Ray cluster
of two nodes with one worker place each (tests/support/ray_cluster.py), LoRA slots `policy`
(adapter a) and `ref_b` (b), the test hooks. Before the fix the plugin refused
`--distributed-executor-backend ray` at start. vLLM's Ray executor (`RayExecutorV2`) keeps
the multiprocessing executor's one ordered queue, so a slot update riding a step reaches both
workers before that step's forward, the worker on the other node over TCP.

Checked:
- the two workers sit on two Ray nodes;
- a LoRA update sent while the engine steps rides its batches (stage and commit on both
  workers): the spans split once, the tokens before the split are the old adapter's greedy
  tokens, and both workers then serve the new adapter (the greedy tokens of `ref_b`, which
  holds it). The tokens after the split decode on the KV the old weights computed, as
  in-flight updates do, so no fresh prefill is their reference;
- a full-weight update in the middle of a generation: the tokens before the split are Hugging
  Face's greedy tokens of the old weights, both workers committed, and the engine then serves
  the new weights' greedy tokens.

The full-weight test changes the base weights, so this module runs last on its server
(`changes_base_weights`).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from support.full_weights import (
    LONG,
    SHORT,
    Server,
    export,
    generate_across_update,
    hf_greedy,
    prompt_ids,
    tokens,
)
from support.server_kinds import ray_cluster_of
from support.streamed_ride import ride_a_stream

from art_protocol.spans import validate_spans

pytestmark = [pytest.mark.serve, pytest.mark.changes_base_weights]

#: Room for the ridden generation (the test ends it once the update settled:
#: tests/support/streamed_ride.py); prompt and tokens fit the server's 512-token context.
RIDE_ROOM = 460
#: Tokens of the generation streamed before the update is sent.
TOKENS_BEFORE_UPDATE = 4
#: Tokens of the new adapter the test sees before it ends the generation.
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def server(ray_tp2_server, tiny_model):
    """The shared ray_tp2 server; this module's exports go to its scratch directory, inside an
    adapter root."""
    return Server(ray_tp2_server, ray_tp2_server.scratch, tiny_model)


def _slot_version(server, slot: str = "policy") -> int:
    slots = httpx.get(server.url + "/art/v1/slots", timeout=60).json()
    return next(s["version"] for s in slots if s["slot"] == slot)


def test_the_engines_two_workers_sit_on_two_ray_nodes(ray_tp2_server):
    cluster = ray_cluster_of(ray_tp2_server)
    nodes = cluster.actor_nodes("RayWorkerProc")
    assert len(nodes) == 2, nodes
    assert len(set(nodes)) == 2, f"both workers on one Ray node: {nodes}"


def test_a_lora_update_while_stepping_rides_both_workers_and_labels_every_token(
    server, tiny_adapters
):
    base = _slot_version(server)
    body = {
        "model": "policy",
        "prompt": prompt_ids(server),
        "max_tokens": RIDE_ROOM,
        "temperature": 0,
        "ignore_eos": True,
    }
    update = {"slot": "policy", "path": str(tiny_adapters / "b"), "version": base + 1}

    def settled(ride) -> bool:
        """Stage, commit and the finish's final ride (the workers drop their undo copy) have
        boarded batches, and tokens of the new adapter have arrived."""
        return ride.rides() >= 3 and ride.tokens_of(base + 1) >= NEW_TOKENS

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            return await ride_a_stream(
                client, body, update, tokens_before=TOKENS_BEFORE_UPDATE, settled=settled
            )

    ride = asyncio.run(run())
    upd = ride.update
    assert upd.status_code == 200, upd.text
    assert [(r["engine"], r["workers"]) for r in upd.json()["receipts"]] == [(0, [0, 1])]
    # stage, commit, and the final ride dropping the undo copy: all rode batches, none was sent
    # as an RPC (the test ended the generation only after the last of them)
    assert ride.rides() == 3
    assert ride.rides("flushed") == 0
    spans = validate_spans(ride.choice, len(ride.tokens), latest_version=base + 1)
    assert [(s["slot"], s["version"]) for s in spans] == [("policy", base), ("policy", base + 1)]
    k = spans[0]["end"]
    # both workers serve adapter b now: the slot's greedy tokens are those of ref_b (adapter b)
    assert tokens(server, 0, model="policy") == tokens(server, 0, model="ref_b")
    # the tokens before the split are adapter a's greedy tokens (a published again: no slot
    # of this server holds it)
    assert _publish(server, tiny_adapters / "a", base + 2) == 200
    assert ride.tokens[:k] == tokens(server, 0, model="policy", max_tokens=k)


def _publish(server, path, version: int) -> int:
    resp = httpx.post(
        server.url + "/art/v1/lora/update",
        json={"slot": "policy", "path": str(path), "version": version},
        timeout=300,
    )
    return resp.status_code


@pytest.fixture(scope="module")
def new_weights(server):
    return export(server, "new", noise=0.05)


@pytest.fixture(scope="module")
def refs(server, new_weights) -> dict[str, list[int]]:
    ids = prompt_ids(server)
    return {"old": hf_greedy(server.model, ids, LONG), "new": hf_greedy(new_weights, ids, SHORT)}


def test_a_full_weight_update_mid_generation_switches_both_workers_at_its_step(
    server, new_weights, refs
):
    start = httpx.get(server.url + "/art/v1/weights", timeout=60).json()["version"]
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
