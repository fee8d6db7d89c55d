"""A slot's weights are the committed ones, whatever path a request carries (real server: the
shared `one_seq` server of tests/support/server_kinds.py).

More slots than `--max-loras 1 --max-cpu-loras 1` force every switch of slot to evict the
previous adapter from the worker's GPU and CPU caches, and `--max-num-seqs 1` makes every
request run alone (batch of one: greedy tokens are exactly reproducible). `ref_a`, `ref_b`,
`ref_c` serve adapters a, b, c from their own files through stock vLLM loading: the greedy
references. vLLM's `/pause?mode=keep` (dev mode) holds a request in the waiting queue, with
the old adapter path on it, while the update commits: no timing involved.
"""

from __future__ import annotations

import asyncio
import random
import shutil

import httpx
import pytest

from art_protocol.client import ArtClient, validate_spans

PROMPTS = (
    "the policy model learns from the reward and the trainer sends",
    "a rollout of the agent gives a reward to the trainer",
    "the server streams tokens for each request of the batch",
)
TOKENS = 24
ADAPTERS = ("a", "b", "c")


@pytest.fixture(scope="module")
def server(one_seq_server):
    """`--max-loras 1 --max-cpu-loras 1 --max-num-seqs 1`, slots policy (a), other (c) and
    ref_a, ref_b, ref_c, vLLM's dev-mode /pause and /resume routes."""
    return one_seq_server


@pytest.fixture(scope="module")
def scratch(server):
    """This module's adapters, inside the server's allowed adapter roots."""
    return server.scratch


@pytest.fixture(scope="module")
def art(server):
    with ArtClient(server.url, timeout=300) as client:
        yield client


def _body(model: str, prompt: str = PROMPTS[0], max_tokens: int = TOKENS) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


def complete(server, model: str, prompt: str = PROMPTS[0]) -> dict:
    resp = httpx.post(server.url + "/v1/completions", json=_body(model, prompt), timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


@pytest.fixture(scope="module")
def references(server) -> dict[tuple[str, str], list[int]]:
    """(adapter, prompt) -> greedy tokens, from slots loaded by stock vLLM from the files."""
    refs = {(n, p): complete(server, f"ref_{n}", p)["token_ids"] for n in ADAPTERS for p in PROMPTS}
    assert len({tuple(refs[(n, PROMPTS[0])]) for n in ADAPTERS}) == 3, "adapters must differ"
    return refs


def _version(art, slot: str = "policy") -> int:
    return {s["slot"]: s["version"] for s in art.slots()}[slot]


def _engine(server) -> dict:
    return httpx.get(server.url + "/art/v1/engine", timeout=60).json()


async def _update_while_request_waits(server, art, slot_path, version, after_commit=None):
    """Evict `policy`, hold a `policy` request in the waiting queue (old path on it), update
    `policy` to `slot_path`, run `after_commit`, resume; returns the request's response."""
    complete(server, "other")  # `other` takes the only GPU and CPU cache slot: policy evicted
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        assert (await client.post("/pause", params={"mode": "keep"})).status_code == 200
        try:
            gen = asyncio.create_task(client.post("/v1/completions", json=_body("policy")))
            while _engine(server)["waiting"] < 1:
                await asyncio.sleep(0.02)
            upd = await client.post(
                "/art/v1/lora/update",
                json={"slot": "policy", "path": str(slot_path), "version": version},
            )
            assert upd.status_code == 200, upd.text
            if after_commit is not None:
                after_commit()
        finally:
            assert (await client.post("/resume")).status_code == 200
        return await gen


def test_reactivated_slot_serves_the_committed_version_not_the_requests_path(
    server, art, references, tiny_adapters
):
    v = _version(art) + 1
    resp = asyncio.run(_update_while_request_waits(server, art, tiny_adapters / "b", v))
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["token_ids"] == references[("b", PROMPTS[0])], "stale adapter re-loaded"
    assert validate_spans(choice, TOKENS, latest_version=v) == [
        {"start": 0, "end": TOKENS, "slot": "policy", "version": v}
    ]
    # Evicted again and re-activated by a new request: still the committed version.
    complete(server, "ref_a")
    assert complete(server, "policy")["token_ids"] == references[("b", PROMPTS[0])]


def test_deleting_superseded_and_committed_dirs_after_update_is_harmless(
    server, art, references, tiny_adapters, scratch
):
    old = shutil.copytree(tiny_adapters / "c", scratch / "old")
    new = shutil.copytree(tiny_adapters / "b", scratch / "new")
    v = _version(art) + 1
    art.update("policy", old, v)  # new requests now carry `old`

    def delete_both():
        shutil.rmtree(old)
        shutil.rmtree(new)

    resp = asyncio.run(_update_while_request_waits(server, art, new, v + 1, delete_both))
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["token_ids"] == references[("b", PROMPTS[0])]
    assert httpx.get(server.url + "/health", timeout=60).status_code == 200
    complete(server, "other")
    assert complete(server, "policy")["token_ids"] == references[("b", PROMPTS[0])]
    assert server.proc.poll() is None


async def _churn(server, art, adapters_dir, n_updates: int, seed: int):
    """Random traffic over every slot while `policy` and `other` get `n_updates` updates."""
    rng = random.Random(seed)
    published: dict[tuple[str, int], str] = {}  # (slot, version) -> adapter
    versions = {s: _version(art, s) for s in ("policy", "other")}
    results = []
    done = asyncio.Event()
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:

        async def traffic(i: int):
            r = random.Random(seed * 100 + i)
            while not done.is_set():
                model = r.choice(["policy", "other", "policy", "ref_a", "ref_b", "ref_c"])
                prompt = r.choice(PROMPTS)
                resp = await client.post("/v1/completions", json=_body(model, prompt, 16))
                results.append((model, prompt, resp))

        async def updates():
            for _ in range(n_updates):
                slot = rng.choice(["policy", "other"])
                adapter = rng.choice(ADAPTERS)
                versions[slot] += 1
                resp = await client.post(
                    "/art/v1/lora/update",
                    json={
                        "slot": slot,
                        "path": str(adapters_dir / adapter),
                        "version": versions[slot],
                    },
                )
                assert resp.status_code == 200, resp.text
                published[(slot, versions[slot])] = adapter
                # Progress-gated, not timed: at least one more request finishes between two
                # updates, however slow the host, so traffic and updates always interleave.
                seen = len(results)
                await asyncio.sleep(rng.uniform(0, 0.05))
                while len(results) <= seen:
                    await asyncio.sleep(0.01)
            done.set()

        await asyncio.gather(updates(), *(traffic(i) for i in range(3)))
    return results, published


def test_hundred_updates_with_random_traffic_match_per_version_references(
    server, art, references, tiny_adapters
):
    # Known starting adapters for both updatable slots (version -> adapter for every token).
    base = {s: _version(art, s) + 1 for s in ("policy", "other")}
    art.update("policy", tiny_adapters / "a", base["policy"])
    art.update("other", tiny_adapters / "c", base["other"])
    results, published = asyncio.run(_churn(server, art, tiny_adapters, 100, seed=11))
    published[("policy", base["policy"])] = "a"
    published[("other", base["other"])] = "c"
    assert len(results) >= 100, f"only {len(results)} requests ran during the updates"
    latest = {s["slot"]: s["version"] for s in art.slots()}
    checked = 0
    for model, prompt, resp in results:
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        tokens = choice["token_ids"]
        spans = validate_spans(choice, 16, latest_version=latest)
        if model.startswith("ref_"):
            assert tokens == references[(model[4:], prompt)][:16]
            continue
        # The first span's tokens were computed by that version's weights from the prompt on.
        first = spans[0]
        ref = references[(published[(model, first["version"])], prompt)]
        assert tokens[: first["end"]] == ref[: first["end"]], (model, spans)
        checked += 1
    assert checked >= 10, f"only {checked} slot requests checked"
