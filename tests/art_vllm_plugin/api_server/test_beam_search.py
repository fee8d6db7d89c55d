"""Beam search answers carry exact spans, on a real `vllm serve`; and the per-beam labels.

vLLM assembles beam-search answers itself, without weight-version labels; the plugin gives
each beam the labels of the one-token engine requests that made its tokens
(`art_vllm_plugin/api_server/beam_search_spans.py`). Stock vLLM answers these requests 200;
so must a plugin server, with spans on every beam.

The shared plain plugin server (`lora` in tests/support/server_kinds.py): slot `policy` serves
adapter a at the version handed over; the update test publishes adapter b while a beam search
runs, after an exact engine step (the engine holds itself there: tests/support/step_hold.py),
so every beam must switch versions at the token the update reached.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from support.step_hold import update_after_steps

from art_protocol.client import validate_spans
from art_vllm_plugin.api_server.beam_search_spans import BeamLabels

PROMPTS = ["the policy model learns from the reward", "a trainer sends new weights"]
BEAMS = 2


@pytest.fixture(scope="module")
def server(lora_server):
    """The shared plain plugin server (slot `policy` on adapter a; step hold, dev mode)."""
    return lora_server


@pytest.fixture(scope="module")
def models(server, tiny_model) -> dict[str, tuple[str, str | None, int]]:
    """Which model -> (model name, the slot and version its spans must carry)."""
    return {
        "base": (str(tiny_model), None, 0),
        "slot": ("policy", "policy", server.start_versions["policy"]),
    }


def post(server, route: str, body: dict) -> dict:
    resp = httpx.post(server.url + route, json=body, timeout=600)
    assert resp.status_code == 200, resp.text
    return resp.json()


def check_beams(choices: list[dict], slot: str | None, version: int) -> None:
    for choice in choices:
        n = len(choice["token_ids"])
        assert n > 0, choice
        assert choice["policy_spans"] == [
            {"start": 0, "end": n, "slot": slot, "version": version}
        ], choice


@pytest.mark.parametrize("which", ["base", "slot"])
def test_beam_search_completions_carry_spans(server, models, which):
    """vLLM's own `test_batch_completions` shape: two prompts, `use_beam_search`, n=2."""
    model, slot, version = models[which]
    body = {
        "model": model,
        "prompt": PROMPTS,
        "max_tokens": 5,
        "n": BEAMS,
        "use_beam_search": True,
        "temperature": 0,
        "return_token_ids": True,
    }
    out = post(server, "/v1/completions", body)
    assert len(out["choices"]) == len(PROMPTS) * BEAMS
    check_beams(out["choices"], slot, version)


@pytest.mark.parametrize("which", ["base", "slot"])
def test_beam_search_chat_carries_spans(server, models, which):
    model, slot, version = models[which]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPTS[0]}],
        "max_tokens": 5,
        "n": BEAMS,
        "use_beam_search": True,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    out = post(server, "/v1/chat/completions", body)
    assert len(out["choices"]) == BEAMS
    check_beams(out["choices"], slot, version)


def test_beam_search_on_an_exact_alias(server):
    version = server.start_versions["policy"]
    body = {
        "model": f"policy@{version}",
        "prompt": PROMPTS[0],
        "max_tokens": 4,
        "n": BEAMS,
        "use_beam_search": True,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    out = post(server, "/v1/completions", body)
    check_beams(out["choices"], "policy", version)


def test_beam_search_through_an_update_gives_each_beam_its_versions(server, tiny_adapters):
    """The update lands after engine step s0+3 of a 10-token beam search: the tokens each beam
    got before it come from the old version, the rest from the new one."""
    tokens = 10
    slots = httpx.get(server.url + "/art/v1/slots", timeout=60).json()
    before = {s["slot"]: s["version"] for s in slots}["policy"]
    body = {
        "model": "policy",
        "prompt": PROMPTS[0],
        "max_tokens": tokens,
        "n": BEAMS,
        "use_beam_search": True,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    update = {"slot": "policy", "path": str(tiny_adapters / "b"), "version": before + 1}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
            return await update_after_steps(
                client, lambda: client.post("/v1/completions", json=body), 3, update
            )

    resp, upd, _ = asyncio.run(run())
    assert resp.status_code == 200, resp.text
    for choice in resp.json()["choices"]:
        spans = validate_spans(choice, tokens, latest_version=upd["version"])
        assert [(s["slot"], s["version"]) for s in spans] == [
            ("policy", before),
            ("policy", upd["version"]),
        ], spans
        assert 0 < spans[0]["end"] < tokens


# -- the per-beam labels, without a server ------------------------------------------------


def _spans(labels: BeamLabels, tokens) -> list[tuple]:
    got = labels.weight_versions(tokens)
    return None if got is None else [(s.version, s.start, s.end) for s in got]


def test_beam_labels_follow_each_beams_own_requests():
    """Prompt [1, 2]; beams (5, 6, 7) and (5, 8, 9) share their first two tokens. An update
    split the step of position 2: the request on prefix (5, 6) ran before it, the one on
    (5, 8) after, so the beams' third tokens carry different labels."""
    labels = BeamLabels(prompt_len=2)
    labels.record([1, 2], "v1")
    labels.record([1, 2, 5], "v1")
    labels.record([1, 2, 5, 6], "v1")
    labels.record([1, 2, 5, 8], "v2")
    assert _spans(labels, [5, 6, 7]) == [("v1", 0, 3)]
    assert _spans(labels, [5, 8, 9]) == [("v1", 0, 2), ("v2", 2, 3)]
    assert _spans(labels, [5, 8]) == [("v1", 0, 2)], "a beam that stopped early"
    assert _spans(labels, []) == []


def test_beam_labels_missing_label_leaves_the_rest_uncovered():
    labels = BeamLabels(prompt_len=1)
    labels.record([4], "v1")
    labels.record([4, 5], None)  # this request reported no label
    assert _spans(labels, [5, 6]) == [("v1", 0, 1)]
    assert BeamLabels(prompt_len=1).weight_versions([5]) is None
