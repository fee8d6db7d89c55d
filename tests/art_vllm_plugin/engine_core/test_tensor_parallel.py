"""Tensor parallelism: with `--tensor-parallel-size 2` every worker stages and commits, and the
tokens and spans are those of a single-worker engine on greedy decoding.

One scenario runs on a `-tp 2` server (the shared `tp2` server of
tests/support/server_kinds.py) and then on a `-tp 1` server of the same flags started for this
test (one after the other: at most one of them is asked to work at a time), and the two
records are compared; each run publishes versions base+1 and base+2 over its own base:

- greedy tokens of adapters a and b agree (the sharded model computes what the whole one
  does);
- after an update to b, a request's tokens equal b's and its one span names the new version;
- an update landing mid-generation (the engine freezes the request after step
  s0 + STEPS_BEFORE_UPDATE itself, as `/pause?mode=keep` would: tests/support/step_hold.py)
  splits the spans at the commit step on both: the first span ends at `step - s0`, its tokens
  are the old version's, the second names the new version.
- every worker committed: the receipt names the worker ranks that swapped the new weights in.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from support.step_hold import update_after_steps

from art_vllm_plugin import serve_process

PROMPT = "the policy model learns from the reward and the trainer sends"
LONG = 96
SHORT = 16
#: Tokens of the generation an update lands in after STEPS_BEFORE_UPDATE steps (the engine
#: holds itself there): the boundary and the tokens after it fit (LONG before: 64 more
#: tokens per server for the same checks).
MID = 32
STEPS_BEFORE_UPDATE = 8


@pytest.fixture(scope="module")
def server(tp2_server):
    """`-tp 2`, float32, slots policy (a) and ref_b (b), vLLM's dev-mode /pause and /resume."""
    return tp2_server


@pytest.fixture(scope="module")
def tp1_config(tiny_model, tiny_adapters, server_log, tmp_path_factory):
    """The same flags with one worker: a server of its own (the single-worker reference is
    the subject of the comparison, no shared server runs it)."""
    from support.server_kinds import tp_config
    from support.server_pool import KindPaths
    from support.vllm_server import TINY

    root = tmp_path_factory.mktemp("tp1")
    paths = KindPaths(tiny_model, tiny_adapters, TINY / "moe", root)
    return tp_config(paths, 1, log_path=server_log.with_name(f"{server_log.stem}-tp1.log"))


async def _complete(client, model: str, max_tokens: int) -> dict:
    resp = await client.post(
        "/v1/completions",
        json={
            "model": model,
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    return {"tokens": choice["token_ids"], "spans": choice["policy_spans"]}


async def _update(client, path, version) -> dict:
    resp = await client.post(
        "/art/v1/lora/update", json={"slot": "policy", "path": str(path), "version": version}
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


async def _scenario(url: str, adapters, base: int) -> dict:
    """`base`: the version of slot `policy` (adapter a) when the scenario starts."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        out: dict = {
            "base": base,
            "ref_a": (await _complete(client, "policy", LONG))["tokens"],
            "ref_b": (await _complete(client, "ref_b", LONG))["tokens"],
        }
        upd = await _update(client, adapters / "b", base + 1)
        out["receipts"] = upd["receipts"]
        out["after"] = await _complete(client, "policy", SHORT)
        # back to a (version base+2) while a generation runs on b, after exactly
        # STEPS_BEFORE_UPDATE of its steps (the engine holds itself there: support/step_hold)
        out["mid"], mid, s0 = await update_after_steps(
            client,
            lambda: _complete(client, "policy", MID),
            STEPS_BEFORE_UPDATE,
            {"slot": "policy", "path": str(adapters / "a"), "version": base + 2},
        )
        out["mid_step"] = mid["step"] - s0
        return out


def _check_mid_generation(run: dict) -> None:
    tokens, spans = run["mid"]["tokens"], run["mid"]["spans"]
    k, base = run["mid_step"], run["base"]
    assert STEPS_BEFORE_UPDATE <= k < MID, "the update must land mid-generation"
    assert spans == [
        {"start": 0, "end": k, "slot": "policy", "version": base + 1},
        {"start": k, "end": MID, "slot": "policy", "version": base + 2},
    ]
    assert tokens[:k] == run["ref_b"][:k]


@pytest.mark.timeout(3600)
def test_tp2_stages_and_commits_on_every_worker_with_the_spans_of_tp1(
    server, tp1_config, tiny_adapters
):
    tp2 = asyncio.run(_scenario(server.url, tiny_adapters, server.start_versions["policy"]))
    with serve_process.serving(tp1_config) as srv:
        tp1 = asyncio.run(_scenario(srv.url, tiny_adapters, 0))
    assert tp2["ref_a"] != tp2["ref_b"]
    for name in ("ref_a", "ref_b"):
        first_diff = next(
            (i for i, (x, y) in enumerate(zip(tp2[name], tp1[name], strict=True)) if x != y), None
        )
        assert first_diff is None, f"{name}: tp=2 and tp=1 greedy tokens differ at {first_diff}"
    for run in (tp2, tp1):
        assert run["after"] == {
            "tokens": tp1["ref_b"][:SHORT],
            "spans": [{"start": 0, "end": SHORT, "slot": "policy", "version": run["base"] + 1}],
        }
    assert [(r["engine"], r["workers"]) for r in tp2["receipts"]] == [(0, [0, 1])]
    assert [(r["engine"], r["workers"]) for r in tp1["receipts"]] == [(0, [0])]
    for run in (tp2, tp1):
        _check_mid_generation(run)
