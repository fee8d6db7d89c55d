"""`GET /art/metrics`: the JSON snapshot, its age guard, and per-slot versions in Prometheus.

The module's server (the shared `one_seq` server of tests/support/server_kinds.py) runs with
`--max-num-seqs 1`, so four concurrent requests leave three waiting for capacity: schema 2's
fields for the autotuner are checked on that real state. Counters the server kept before this
module (its steps, updates, preemptions) are read as differences.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

FIELDS = {
    "schema_version",
    "snapshot_time",
    "age_s",
    "engine_step",
    "num_running",
    "num_waiting",
    "num_waiting_for_capacity",
    "num_waiting_deferred",
    "idle",
    "max_num_seqs",
    "max_num_batched_tokens",
    "preemptions_total",
    "kv_cache_usage",
    "prefix_cache_hit_rate",
    "generation_tokens_per_s",
    "generation_tokens_window_s",
    "slots",
    "updates_total",
    "failed_updates_total",
    "engines",
}


MAX_NUM_SEQS = 1
CONCURRENT = 4


@pytest.fixture(scope="module")
def server(one_seq_server):
    """`--max-num-seqs 1` (MAX_NUM_SEQS), slot `policy` handed over on adapter a."""
    return one_seq_server


def get(server, route, **params):
    return httpx.get(server.url + route, params=params, timeout=60)


def generate(server, n=3):
    for i in range(n):
        resp = httpx.post(
            server.url + "/v1/completions",
            timeout=120,
            json={
                "model": "policy",
                "prompt": f"the policy {i}",
                "max_tokens": 32,
                "ignore_eos": True,
            },
        )
        assert resp.status_code == 200


def test_snapshot_reports_engine_activity(server):
    before = get(server, "/art/metrics").json()
    generate(server)
    snap = get(server, "/art/metrics").json()
    assert set(snap) >= FIELDS
    assert snap["schema_version"] == 4
    # one engine: its entry is the deployment
    (engine,) = snap["engines"]
    assert engine["engine"] == 0
    assert {k: v for k, v in engine.items() if k not in ("engine", "age_s")} == {
        k: snap[k] for k in engine if k not in ("engine", "age_s")
    }
    assert snap["max_num_seqs"] == MAX_NUM_SEQS and snap["max_num_batched_tokens"] > 0
    assert snap["num_waiting_for_capacity"] == 0 and snap["num_waiting_deferred"] == 0
    assert snap["idle"] is True  # every request above has finished
    # 1 GiB of KV cache holds three short requests
    assert snap["preemptions_total"] == before["preemptions_total"]
    assert snap["engine_step"] - before["engine_step"] >= 3 * 32
    assert snap["generation_tokens_total"] - before["generation_tokens_total"] >= 3 * 32
    assert snap["generation_tokens_per_s"] > 0
    assert 0 <= snap["kv_cache_usage"] <= 1
    assert snap["age_s"] < 30 and abs(snap["snapshot_time"] - time.time()) < 30
    assert snap["slots"]["policy"]["version"] == server.start_versions["policy"]


#: Snapshots showing the full state the capacity test checks before it ends its first request.
FULL_SNAPSHOTS = 3


def test_waiting_for_capacity_counts_requests_beyond_max_num_seqs(server):
    """Four requests on a 1-sequence server: while the first one runs, the snapshot shows one
    running, three waiting for capacity, and not idle; afterwards idle again. The first is a
    stream the test ends once it has read FULL_SNAPSHOTS such snapshots (before: four 400-token
    requests, polled until they ended); the three behind it are short."""
    waiting = CONCURRENT - MAX_NUM_SEQS
    asyncio.run(_capacity(server, waiting))


async def _capacity(server, waiting: int) -> None:
    def body(i: int, max_tokens: int, **extra) -> dict:
        return {
            "model": "policy",
            "prompt": f"capacity {i}",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            **extra,
        }

    full = []
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        first = body(0, 400, stream=True)
        async with client.stream("POST", "/v1/completions", json=first) as running:
            assert running.status_code == 200, await running.aread()
            # held, not dropped: a dropped line iterator closes the stream (vLLM aborts it)
            lines = running.aiter_lines()
            async for line in lines:  # it runs once its first chunk arrives
                if line.startswith("data: {"):
                    break
            behind = [
                asyncio.create_task(client.post("/v1/completions", json=body(i, 8)))
                for i in range(1, CONCURRENT)
            ]
            # the requests behind can only end after the first one: this loop ends at the latest
            # when the first one reached its 400 tokens
            while len(full) < FULL_SNAPSHOTS and not all(t.done() for t in behind):
                snap = (await client.get("/art/metrics")).json()
                if snap["num_running"] == MAX_NUM_SEQS and snap["num_waiting"] == waiting:
                    full.append(snap)
                await asyncio.sleep(0.02)
        # the stream is closed: vLLM aborts the first request and runs the others
        statuses = [(await t).status_code for t in behind]
        assert statuses == [200] * (CONCURRENT - 1)
        after = (await client.get("/art/metrics")).json()
    assert len(full) == FULL_SNAPSHOTS, (
        f"no snapshot showed {MAX_NUM_SEQS} running and {waiting} waiting"
    )
    assert all(s["num_waiting_for_capacity"] == waiting and s["idle"] is False for s in full)
    assert after["idle"] is True and after["num_waiting_for_capacity"] == 0


def test_update_counts_match_what_happened(server, tiny_adapters):
    before = get(server, "/art/metrics").json()
    base = before["slots"]["policy"]["version"]
    url = server.url + "/art/v1/lora/update"
    ok = [
        httpx.post(
            url, json={"slot": "policy", "path": str(tiny_adapters / n), "version": v}, timeout=60
        )
        for n, v in (("b", base + 1), ("c", base + 2))
    ]
    assert [r.status_code for r in ok] == [200, 200]
    stale = {"slot": "policy", "path": str(tiny_adapters / "a"), "version": base + 1}
    bad = [
        httpx.post(url, json=stale, timeout=60),  # stale: 409, counted on the slot
        httpx.post(url, json={"slot": "nope", "path": "x", "version": 9}, timeout=60),  # 404
        httpx.post(url, json={"slot": "policy"}, timeout=60),  # 400
    ]
    assert [r.status_code for r in bad] == [409, 404, 400]
    snap = get(server, "/art/metrics").json()
    assert snap["updates_total"] - before["updates_total"] == 2
    assert snap["failed_updates_total"] - before["failed_updates_total"] == 3
    slot, was = snap["slots"]["policy"], before["slots"]["policy"]
    assert slot["version"] == base + 2
    assert slot["updates"] - was["updates"] == 2
    assert slot["failed_updates"] - was["failed_updates"] == 1
    assert slot["last_update_ms"] > 0


def test_max_age_refuses_a_stale_snapshot(server):
    generate(server, n=1)
    time.sleep(1.5)  # idle: no engine step reports, the snapshot ages
    resp = get(server, "/art/metrics", max_age_s=0.5)
    assert resp.status_code == 503
    assert "older than max_age_s=0.5" in resp.json()["error"]["message"]
    assert get(server, "/art/metrics", max_age_s=600).status_code == 200
    generate(server, n=1)
    assert get(server, "/art/metrics", max_age_s=5).status_code == 200


def test_prometheus_keeps_working_and_exports_slot_versions(server):
    text = get(server, "/metrics").text
    assert "vllm:num_requests_running" in text
    version = get(server, "/art/metrics").json()["slots"]["policy"]["version"]
    assert f'art:slot_version{{slot="policy"}} {float(version)}' in text
