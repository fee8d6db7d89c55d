"""Tensor parallelism: with `--tensor-parallel-size 2` every worker stages and commits, and the
tokens and spans are those of a single-worker engine on greedy decoding.

One scenario runs on a `-tp 2` server and then on a `-tp 1` server (one after the other: at
most one server alive), and the two records are compared:

- greedy tokens of adapters a and b agree (the sharded model computes what the whole one
  does);
- after an update to b, a request's tokens equal b's and its one span names the new version;
- an update landing mid-generation (vLLM's `/pause?mode=keep` freezes the request between two
  steps, `VLLM_SERVER_DEV_MODE=1`) splits the spans at the commit step on both: the first span
  ends at `step - s0`, its tokens are the old version's, the second names the new version.
  Where the pause lands is up to the host's timing, so the split point is compared by rule
  (each run against its own commit step), not by index.
- every worker committed: the receipt names the worker ranks that swapped the new weights in.
"""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest

from art_vllm_plugin import serve_process

PROMPT = "the policy model learns from the reward and the trainer sends"
LONG = 96
SHORT = 16
STEPS_BEFORE_UPDATE = 8


def _two_cpus() -> str:
    cpus = sorted(os.sched_getaffinity(0))
    return f"{cpus[0]}|{cpus[1 % len(cpus)]}"


def _config(tiny_model, tiny_adapters, server_log, tp: int) -> serve_process.ServeConfig:
    env = {"VLLM_SERVER_DEV_MODE": "1"}  # vLLM's /pause and /resume routes
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = _two_cpus()  # one core per worker
    return serve_process.ServeConfig(
        model=str(tiny_model),
        args=(
            *serve_process.tiny_lora_args(max_loras=2),
            "--tensor-parallel-size",
            str(tp),
            # bf16 sums split over two ranks round differently and greedy tokens drift apart
            # after a few dozen tokens; float32 keeps the sharded sums equal to the whole.
            "--dtype",
            "float32",
            "--lora-modules",
            f"policy={tiny_adapters / 'a'}",
            f"ref_b={tiny_adapters / 'b'}",
            "--art-adapter-root",
            str(tiny_adapters),
        ),
        env=env,
        log_path=server_log.with_name(f"{server_log.stem}-tp{tp}.log"),
        startup_timeout_s=900.0,
    )


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


async def _steps(client) -> int:
    return (await client.get("/art/v1/engine")).json()["steps"]


async def _scenario(url: str, adapters) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        out: dict = {
            "ref_a": (await _complete(client, "policy", LONG))["tokens"],
            "ref_b": (await _complete(client, "ref_b", LONG))["tokens"],
        }
        upd = await _update(client, adapters / "b", 1)
        out["receipts"] = upd["receipts"]
        out["after"] = await _complete(client, "policy", SHORT)
        # back to a (version 2) while a generation runs on b
        s0 = await _steps(client)
        gen = asyncio.create_task(_complete(client, "policy", LONG))
        while await _steps(client) < s0 + STEPS_BEFORE_UPDATE:
            assert not gen.done(), "the generation ended before the update; nothing landed"
            await asyncio.sleep(0.01)
        paused = await client.post("/pause", params={"mode": "keep", "clear_cache": "false"})
        assert paused.status_code == 200, paused.text
        try:
            mid = await _update(client, adapters / "a", 2)
        finally:
            resumed = await client.post("/resume")
        assert resumed.status_code == 200, resumed.text
        out["mid"] = await gen
        out["mid_step"] = mid["step"] - s0
        return out


def _check_mid_generation(run: dict) -> None:
    tokens, spans = run["mid"]["tokens"], run["mid"]["spans"]
    k = run["mid_step"]
    assert STEPS_BEFORE_UPDATE <= k < LONG, "the update must land mid-generation"
    assert spans == [
        {"start": 0, "end": k, "slot": "policy", "version": 1},
        {"start": k, "end": LONG, "slot": "policy", "version": 2},
    ]
    assert tokens[:k] == run["ref_b"][:k]


@pytest.mark.timeout(3600)
def test_tp2_stages_and_commits_on_every_worker_with_the_spans_of_tp1(
    tiny_model, tiny_adapters, server_log
):
    runs = {}
    for tp in (2, 1):
        with serve_process.serving(_config(tiny_model, tiny_adapters, server_log, tp)) as srv:
            runs[tp] = asyncio.run(_scenario(srv.url, tiny_adapters))
    tp2, tp1 = runs[2], runs[1]
    assert tp2["ref_a"] != tp2["ref_b"]
    for name in ("ref_a", "ref_b"):
        first_diff = next(
            (i for i, (x, y) in enumerate(zip(tp2[name], tp1[name], strict=True)) if x != y), None
        )
        assert first_diff is None, f"{name}: tp=2 and tp=1 greedy tokens differ at {first_diff}"
    assert (
        tp2["after"]
        == tp1["after"]
        == {
            "tokens": tp1["ref_b"][:SHORT],
            "spans": [{"start": 0, "end": SHORT, "slot": "policy", "version": 1}],
        }
    )
    assert [(r["engine"], r["workers"]) for r in tp2["receipts"]] == [(0, [0, 1])]
    assert [(r["engine"], r["workers"]) for r in tp1["receipts"]] == [(0, [0])]
    for run in (tp2, tp1):
        _check_mid_generation(run)
