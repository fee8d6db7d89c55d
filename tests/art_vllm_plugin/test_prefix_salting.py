"""Version-salted prefix caching on a real server (`--enable-prompt-tokens-details`).

`--max-num-seqs 1` makes a second request wait while one runs, so an update can land while a
request waits: the case "admitted in the same step as an update".
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from art_vllm_plugin import serve_process

LONG_PROMPT = " ".join(f"step {i} the policy learns from reward {i % 7}" for i in range(24))


@pytest.fixture(scope="module")
def server(tiny_model, tiny_adapters, server_log):
    config = serve_process.ServeConfig(
        model=str(tiny_model),
        args=(
            *serve_process.tiny_lora_args(),
            "--lora-modules",
            f"policy={tiny_adapters / 'a'}",
            "--enable-prompt-tokens-details",
            "--block-size",
            "32",
            "--max-num-seqs",
            "1",
        ),
        log_path=server_log,
    )
    with serve_process.serving(config) as srv:
        yield srv


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
    return httpx.get(server.url + "/art/v1/slots", timeout=60).json()[0]["version"]


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


async def _waiting_request(server, adapter, new_version):
    """A long request runs; the probe waits behind it; optionally update meanwhile."""
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        steps0 = (await client.get("/art/v1/engine")).json()["steps"]
        blocker = asyncio.create_task(
            client.post(
                "/v1/completions",
                json={"model": "policy", "prompt": "block", "max_tokens": 460, "ignore_eos": True},
            )
        )
        while (await client.get("/art/v1/engine")).json()["steps"] <= steps0:
            await asyncio.sleep(0.005)
        probe = asyncio.create_task(
            client.post(
                "/v1/completions",
                json={"model": "policy", "prompt": LONG_PROMPT, "max_tokens": 2, "temperature": 0},
            )
        )
        while (await client.get("/art/v1/engine")).json()["waiting"] < 1:
            if probe.done():  # the machine delayed our poll past the wait: try again
                await blocker
                return None
            await asyncio.sleep(0.005)
        upd = None
        if new_version is not None:
            upd = (
                await client.post(
                    "/art/v1/lora/update",
                    json={"slot": "policy", "path": str(adapter), "version": new_version},
                )
            ).json()
        probe_resp, blocker_resp = await probe, await blocker
    assert blocker_resp.status_code == 200 and probe_resp.status_code == 200
    return probe_resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"], upd


def waiting_request(server, adapter, new_version, attempts=3):
    for _ in range(attempts):
        result = asyncio.run(_waiting_request(server, adapter, new_version))
        if result is not None:
            return result
    raise AssertionError(f"never observed the probe waiting in {attempts} attempts")


def test_request_waiting_during_an_update_is_resalted(server, tiny_adapters):
    cached(server)  # warm the cache at the current version
    hits, _ = waiting_request(server, None, None)
    assert hits > 0, "control: a waiting request hits the cache when nothing changes"
    cached(server)
    hits, upd = waiting_request(server, tiny_adapters / "a", version(server) + 1)
    assert upd["resalted_waiting"] == 1, upd
    assert hits == 0, "a request still waiting when its slot updates must not reuse old KV"
