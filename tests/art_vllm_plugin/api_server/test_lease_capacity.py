"""A pinned exact lease must not take a `--max-loras` batch slot for good.

With `--max-loras 2`, slot `policy` busy and a lease `shadow@N` pinned, a batch that mixes
`policy` and `shadow` (two distinct LoRAs, which vLLM's scheduler allows) used to evict an
adapter of that same batch from the device slots (the lease held the other one pinned) and the
request got HTTP 500. Requests on more adapters than `--max-loras` must wait for a slot and
return the right tokens. The batch is made deterministic with vLLM's dev-mode
`POST /pause?mode=keep`: all requests wait in the queue, then `/resume` schedules them together.
"""

from __future__ import annotations

import asyncio
import shutil

import httpx
import pytest

PROMPT = "the policy model learns from the reward and the trainer sends"
TOKENS = 24


def _body(model: str) -> dict:
    return {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


@pytest.fixture(scope="module")
def server(two_slots_server):
    """The shared `two_slots` server (tests/support/server_kinds.py): two device slots
    (`--max-loras 2`) for four LoRA modules (`policy`=a, `shadow`=b, `ref_a`=a, `ref_c`=c), all
    resident in the CPU cache (`--max-cpu-loras 6`), is the shape under test."""
    return two_slots_server


def complete(server, model: str) -> list[int]:
    resp = httpx.post(server.url + "/v1/completions", json=_body(model), timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def references(server) -> dict[str, list[int]]:
    refs = {name: complete(server, f"ref_{name}") for name in "ac"}
    assert refs["a"] != refs["c"], "adapters must differ"
    return refs


@pytest.fixture(scope="module")
def lease(server, references, tiny_adapters) -> dict:
    """Slot `shadow` moved to adapter c at its next version, that version pinned by a lease
    (released when the module ends: the server is shared)."""
    version = server.start_versions["shadow"] + 1
    path = shutil.copytree(tiny_adapters / "c", server.scratch / f"shadow_v{version}")
    upd = httpx.post(
        server.url + "/art/v1/lora/update",
        json={"slot": "shadow", "path": str(path), "version": version},
        timeout=300,
    )
    assert upd.status_code == 200, upd.text
    resp = httpx.post(
        server.url + "/art/v1/leases", json={"slot": "shadow", "version": version, "ttl_s": 900}
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == f"shadow@{version}"
    yield resp.json()
    gone = httpx.delete(server.url + f"/art/v1/leases/{resp.json()['id']}", timeout=60)
    assert gone.status_code == 200, gone.text


async def _together(server, models: list[str]) -> list[httpx.Response]:
    """Queue one request per model while the engine is paused, then resume: the scheduler
    sees them all at once (at most `--max-loras` distinct LoRAs per batch, the rest wait)."""
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        assert (await client.post("/pause", params={"mode": "keep"})).status_code == 200
        try:
            gens = [
                asyncio.create_task(client.post("/v1/completions", json=_body(m))) for m in models
            ]
            while (await client.get("/art/v1/engine")).json()["waiting"] < len(models):
                await asyncio.sleep(0.02)
        finally:
            assert (await client.post("/resume")).status_code == 200
        return list(await asyncio.gather(*gens))


@pytest.mark.parametrize(
    "roles",
    [["policy", "shadow"], ["policy", "lease"], ["policy", "shadow", "lease"]],
    ids=["slot", "lease", "three-adapters"],
)
def test_mixed_batch_with_pinned_lease_waits_for_a_lora_slot(server, references, lease, roles):
    """`lease` is the pinned `shadow@<version>`."""
    models = [lease["model"] if role == "lease" else role for role in roles]
    expected = {
        "policy": references["a"],
        "shadow": references["c"],
        lease["model"]: references["c"],
    }
    for model, resp in zip(models, asyncio.run(_together(server, models)), strict=True):
        assert resp.status_code == 200, f"{model}: {resp.status_code} {resp.text}"
        assert resp.json()["choices"][0]["token_ids"] == expected[model], model


def test_lease_serves_its_version_after_leaving_the_device_slots(server, references, lease):
    complete(server, "policy")
    complete(server, "ref_a")  # two other adapters take both device slots
    assert complete(server, lease["model"]) == references["c"]
