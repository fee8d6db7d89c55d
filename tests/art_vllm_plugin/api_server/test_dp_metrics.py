"""`/art/metrics` with data parallelism: every API server reports every engine, and their sum.

The shared `dp2` server (tests/support/server_kinds.py: `--data-parallel-size 2`, so two
engines and, by vLLM's default, two API-server processes). vLLM hands each engine step's stats
to one API server only; before, each API server also let the engines overwrite one feed, so it
answered with whichever engine's step it saw last (one kept answering `num_running: 3` with
both engines idle). Now each engine pushes its own figures to every API server.

Which API server answers is the kernel's choice (they share one listening socket), so the
module opens persistent connections until it holds one to each. Which engine serves a request
is vLLM's load balancer's choice; that both served is read from each engine's own figures.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from support.api_server_clients import one_client_per_api_server

PROMPT = "the policy model learns from the reward and the trainer sends"
MAX_TOKENS = 8
REQUESTS = 8
#: Top-level fields that are the sum of the engines' own.
SUMMED = (
    "engine_step",
    "num_running",
    "num_waiting",
    "num_waiting_for_capacity",
    "num_waiting_deferred",
    "preemptions_total",
    "generation_tokens_total",
    "generation_tokens_per_s",
    "max_num_seqs",
    "max_num_batched_tokens",
)


@pytest.fixture(scope="module")
def server(dp2_server):
    """`--data-parallel-size 2` (two API servers), slots policy and ref_b."""
    return dp2_server


@pytest.fixture(scope="module")
def api_servers(server):
    """Two clients, each holding one connection to a different API-server process."""
    with one_client_per_api_server(server.url) as clients:
        yield clients


def metrics(client) -> dict:
    resp = client.get("/art/metrics")
    assert resp.status_code == 200, resp.text
    return resp.json()


async def _generate(url: str) -> list[httpx.Response]:
    body = {
        "model": "policy",
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        return await asyncio.gather(
            *(client.post("/v1/completions", json=body) for _ in range(REQUESTS))
        )


def by_engine(snap: dict) -> dict[int, dict]:
    return {e["engine"]: e for e in snap["engines"]}


def test_every_api_server_reports_each_engine_and_their_sum_after_a_drain(server, api_servers):
    before = [by_engine(metrics(c)) for c in api_servers]
    assert all(sorted(b) == [0, 1] for b in before), before
    responses = asyncio.run(_generate(server.url))  # concurrent: both engines, both API servers
    assert [r.status_code for r in responses] == [200] * REQUESTS
    snaps = [metrics(c) for c in api_servers]
    for snap, was in zip(snaps, before, strict=True):
        engines = by_engine(snap)
        assert sorted(engines) == [0, 1]
        stepped = {e for e in engines if engines[e]["engine_step"] > was[e]["engine_step"]}
        assert stepped == {0, 1}, f"this API server saw steps of engines {stepped} only"
        generated = sum(
            engines[e]["generation_tokens_total"] - was[e]["generation_tokens_total"]
            for e in engines
        )
        assert generated == REQUESTS * MAX_TOKENS, "every engine's every token, on each"
        for name in SUMMED:
            assert snap[name] == sum(e[name] for e in snap["engines"]), name
        assert snap["num_running"] == 0 and snap["num_waiting"] == 0 and snap["idle"] is True
        assert all(e["num_running"] == 0 and e["idle"] for e in snap["engines"])
    # both API servers hold the same engine figures (the engines' own)
    counters = ("engine_step", "generation_tokens_total", "preemptions_total")
    a, b = (by_engine(s) for s in snaps)
    assert {e: [a[e][n] for n in counters] for e in a} == {
        e: [b[e][n] for n in counters] for e in b
    }


def test_an_update_through_one_api_server_is_in_the_others_metrics_at_once(
    api_servers, tiny_adapters
):
    """The other API server answers from its cached registry until engine 0 pushes a new
    registry generation: the update must be there by the time it returned."""
    a, b = api_servers
    for via, other in ((a, b), (b, a)):
        metrics(other)  # cached at the current generation
        v = metrics(via)["slots"]["policy"]["version"] + 1
        resp = via.post(
            "/art/v1/lora/update",
            json={"slot": "policy", "path": str(tiny_adapters / "b"), "version": v},
        )
        assert resp.status_code == 200, resp.text
        slot = metrics(other)["slots"]["policy"]
        assert slot["version"] == v and slot == metrics(via)["slots"]["policy"]
