"""Version-salted prefix caching on a real server (the shared `one_seq` server of
tests/support/server_kinds.py: `--enable-prompt-tokens-details --block-size 32`).

`--max-num-seqs 1` makes a second request wait while one runs, so an update can land while a
request waits: the case "admitted in the same step as an update".
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

LONG_PROMPT = " ".join(f"step {i} the policy learns from reward {i % 7}" for i in range(24))


@pytest.fixture(scope="module")
def server(one_seq_server):
    """`--max-num-seqs 1`, block size 32, cached tokens reported; handed over with an empty
    prefix cache."""
    return one_seq_server


def cached(server, model="policy", prompt=LONG_PROMPT, **extra) -> int:
    resp = httpx.post(
        server.url + "/v1/completions",
        timeout=300,
        json={"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra},
    )
    assert resp.status_code == 200, resp.text
    details = resp.json()["usage"]["prompt_tokens_details"]
    return details["cached_tokens"] if details else 0


def update(server, adapter, version):
    resp = httpx.post(
        server.url + "/art/v1/lora/update",
        timeout=120,
        json={"slot": "policy", "path": str(adapter), "version": version},
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def version(server) -> int:
    slots = httpx.get(server.url + "/art/v1/slots", timeout=60).json()
    return {s["slot"]: s["version"] for s in slots}["policy"]


def test_prompt_is_longer_than_a_block(server):
    resp = httpx.post(
        server.url + "/v1/completions",
        timeout=60,
        json={"model": "policy", "prompt": LONG_PROMPT, "max_tokens": 1},
    )
    assert resp.json()["usage"]["prompt_tokens"] > 3 * 32


def test_cache_hits_within_a_version_and_not_across(server, tiny_adapters):
    cached(server)
    assert cached(server) > 0, "same prompt at the same version reuses KV"
    update(server, tiny_adapters / "b", version(server) + 1)
    assert cached(server) == 0, "KV computed by the old policy must not be reused"
    assert cached(server) > 0, "the new version caches again"


def test_user_cache_salt_still_separates_users(server):
    cached(server, cache_salt="user-1")
    assert cached(server, cache_salt="user-1") > 0
    assert cached(server, cache_salt="user-2") == 0
    assert cached(server, cache_salt="user-1") > 0


def test_base_model_keeps_stock_caching(server, tiny_model, tiny_adapters):
    cached(server, model=str(tiny_model))
    assert cached(server, model=str(tiny_model)) > 0
    update(server, tiny_adapters / "c", version(server) + 1)
    assert cached(server, model=str(tiny_model)) > 0, "an update does not touch base KV"


async def _probe_behind_blocker(server, update=None):
    """A streamed request runs; a probe is sent behind it and waits (--max-num-seqs 1); once
    the engine reports it waiting, the update is published if `update=(path, version)`; then
    the test ends the blocker (closing its stream aborts it) and the probe runs. So the probe
    always waits through the update (before: a 460-token blocker, the update sent 50 ms after
    the probe, up to six tries until it landed while the probe waited).

    Returns (probe cached tokens, probe spans, update result or None).
    """
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        body = {
            "model": "policy",
            "prompt": "block",
            "max_tokens": 460,
            "ignore_eos": True,
            "stream": True,
        }
        async with client.stream("POST", "/v1/completions", json=body) as blocker:
            # held, not dropped: a dropped line iterator closes the stream (vLLM aborts it)
            lines = blocker.aiter_lines()
            async for line in lines:  # scheduled once its first chunk arrives
                if line.startswith("data: {"):
                    break
            probe = asyncio.create_task(
                client.post(
                    "/v1/completions",
                    json={
                        "model": "policy",
                        "prompt": LONG_PROMPT,
                        "max_tokens": 2,
                        "temperature": 0,
                    },
                )
            )
            while (await client.get("/art/metrics")).json()["num_waiting"] < 1:
                assert not probe.done(), "the probe ran beside the blocker"
                await asyncio.sleep(0.02)
            upd = None
            if update is not None:
                resp = await client.post(
                    "/art/v1/lora/update",
                    json={"slot": "policy", "path": str(update[0]), "version": update[1]},
                )
                assert resp.status_code == 200, resp.text
                upd = resp.json()
            assert not probe.done(), "the probe did not wait behind the blocker"
        resp = (await probe).json()
    return (
        resp["usage"]["prompt_tokens_details"]["cached_tokens"],
        resp["choices"][0]["policy_spans"],
        upd,
    )


def test_waiting_request_hits_the_cache_when_nothing_changes(server):
    cached(server)
    hits, _, _ = asyncio.run(_probe_behind_blocker(server))
    assert hits > 0


def test_request_waiting_during_an_update_is_resalted(server, tiny_adapters):
    """The update lands while the probe waits: the probe's prefill, computed by the new
    version (its spans say so), looks up cached blocks only under that version's salt."""
    cached(server)  # warm the cache at the current version
    old = version(server)
    hits, spans, upd = asyncio.run(
        _probe_behind_blocker(server, update=(tiny_adapters / "a", old + 1))
    )
    assert upd["resalted_waiting"] >= 1, "the update did not land while the probe waited"
    assert spans[0]["version"] == upd["version"] == old + 1
    assert hits == 0, "a request computed by the new version reused old KV"
