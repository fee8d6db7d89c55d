"""Routes from a real `vllm serve --plugin art --art-routes` of the tiny Qwen3-MoE (CPU build).

The shared `moe_routes` server of tests/support/server_kinds.py (float32, eager, block size 32
so that a 70-token prompt spans full prefix-cache blocks). What is checked:

- the rows are the experts the router selected: equal to HF transformers' router top-k (same
  weights, float32) on every row whose k-th and (k+1)-th router logits are not near-tied;
- a prompt partly served from the prefix cache gets exactly the rows of the forward that
  computed the cached blocks, and the same routes as the same prompt computed uncached;
- rows = prompt + completion - 1 - routes_prompt_start; `routes_prompt_start` drops exactly
  the first rows; n > 1 and chat; stock `/v1/completions` carries the same routes as vLLM's
  base64 `.npy` field; refusals (stream, bad start, over the size limit) name the problem.
"""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
import torch
from support.server_kinds import MOE_BLOCK, ROUTES_MAX_BYTES

from art_protocol.client import decode_routed_completion
from art_protocol.routed_completion import MEDIA_TYPE

pytestmark = pytest.mark.serve

MAX_BODY = ROUTES_MAX_BYTES
BLOCK = MOE_BLOCK


@pytest.fixture(scope="module")
def server(moe_routes_server):
    """The tiny Qwen3-MoE with `--art-routes`, `ART_VLLM_ROUTES_MAX_BYTES=MAX_BODY`."""
    return moe_routes_server


@pytest.fixture(scope="module")
def moe_model(server):
    return server.config.model


def _routed(server, model, path="/art/v1/completions", **body):
    body = {"model": model, "temperature": 0, "return_routes": True, **body}
    resp = httpx.post(server.url + path, json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == MEDIA_TYPE
    return decode_routed_completion(resp.content)


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


@pytest.fixture(scope="module")
def hf_model(moe_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32).eval()


def _hf_router_topk(model, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """HF's top-k experts per token and MoE layer, and whether the choice is clear (margin)."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    logits = [layer.float().reshape(len(ids), -1) for layer in out.router_logits]
    top = model.config.num_experts_per_tok
    experts, clear = [], []
    for layer in logits:
        values, index = layer.sort(dim=-1, descending=True)
        experts.append(index[:, :top].numpy())
        gaps = (values[:, :top] - values[:, 1 : top + 1]).abs().min(dim=-1).values
        clear.append((gaps > 1e-3).numpy())
    return np.stack(experts, axis=1), np.stack(clear, axis=1).all(axis=1)


def test_capabilities_report_routes(server):
    feature = httpx.get(server.url + "/art/v1/capabilities").json()["features"]["moe_routes"]
    assert feature["enabled"] is True


def test_routes_are_the_experts_the_router_selected(server, moe_model, hf_model):
    prompt = _prompt(1, 40)
    routed = _routed(server, moe_model, prompt=prompt, max_tokens=12, return_token_ids=True)
    choice = routed.completion["choices"][0]
    ids = prompt + choice["token_ids"]
    rows = routed.routes[0]
    assert rows.shape == (len(ids) - 1, 2, 2)  # two MoE layers (layer 0 is dense), top-2
    assert choice["routes"] == {"rows": len(ids) - 1, "prompt_start": 0, "prompt_tokens": 40}
    experts, clear = _hf_router_topk(hf_model, ids[:-1])
    assert clear.mean() > 0.8, "too many near-ties to make this check meaningful"
    np.testing.assert_array_equal(rows[clear], experts[clear])


def test_concurrent_requests_in_one_batch_each_get_their_own_rows(server, moe_model, hf_model):
    """Requests batched together: each row lands at its own request's positions."""
    import asyncio

    prompts = [_prompt(20 + i, 17 + 9 * i) for i in range(3)]

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        server.url + "/art/v1/completions",
                        json={
                            "model": moe_model,
                            "prompt": p,
                            "max_tokens": 16,
                            "temperature": 0,
                            "ignore_eos": True,
                            "return_token_ids": True,
                            "return_routes": True,
                        },
                    )
                    for p in prompts
                )
            )

    for prompt, resp in zip(prompts, asyncio.run(run()), strict=True):
        assert resp.status_code == 200, resp.text
        routed = decode_routed_completion(resp.content)
        ids = prompt + routed.completion["choices"][0]["token_ids"]
        experts, clear = _hf_router_topk(hf_model, ids[:-1])
        assert routed.routes[0].shape[0] == len(ids) - 1
        assert clear.mean() > 0.8
        np.testing.assert_array_equal(routed.routes[0][clear], experts[clear])


def test_without_return_routes_the_answer_is_plain_json_without_route_arrays(server, moe_model):
    resp = httpx.post(
        server.url + "/art/v1/completions",
        json={"model": moe_model, "prompt": [5, 6, 7], "max_tokens": 3},
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    choice = resp.json()["choices"][0]
    assert "routed_experts" not in choice and choice["policy_spans"][-1]["end"] == 3


def test_partly_cached_prompt_gets_the_routes_of_the_forward_that_computed_it(server, moe_model):
    head, tail = _prompt(2, 2 * BLOCK), _prompt(3, 20)
    salt = {"cache_salt": "routes-prefix"}
    first = _routed(server, moe_model, prompt=head + _prompt(4, 6), max_tokens=4, **salt)
    assert (first.completion["usage"].get("prompt_tokens_details") or {}).get(
        "cached_tokens", 0
    ) == 0
    hit = _routed(server, moe_model, prompt=head + tail, max_tokens=4, **salt)
    assert hit.completion["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * BLOCK
    cold = _routed(
        server, moe_model, prompt=head + tail, max_tokens=4, cache_salt="routes-uncached"
    )
    assert (cold.completion["usage"].get("prompt_tokens_details") or {}).get(
        "cached_tokens", 0
    ) == 0
    # cached rows: exactly those the first request's forward selected
    np.testing.assert_array_equal(hit.routes[0][: 2 * BLOCK], first.routes[0][: 2 * BLOCK])
    # and the whole trajectory equals the uncached computation
    np.testing.assert_array_equal(hit.routes[0], cold.routes[0])


def test_prompt_start_skips_exactly_the_first_rows(server, moe_model):
    prompt = _prompt(5, 30)
    full = _routed(server, moe_model, prompt=prompt, max_tokens=6)
    part = _routed(server, moe_model, prompt=prompt, max_tokens=6, routes_prompt_start=25)
    assert part.routes[0].shape[0] == full.routes[0].shape[0] - 25
    np.testing.assert_array_equal(part.routes[0], full.routes[0][25:])
    spans = part.completion["choices"][0]["route_spans"]
    assert spans[0]["start"] == 0 and spans[-1]["end"] == part.routes[0].shape[0]


def test_n_choices_each_get_their_rows_and_spans(server, moe_model):
    routed = _routed(
        server, moe_model, prompt=_prompt(6, 20), max_tokens=8, n=3, temperature=1.0, seed=7
    )
    choices = routed.completion["choices"]
    assert len(choices) == len(routed.routes) == 3
    for choice, rows in zip(choices, routed.routes, strict=True):
        completion_tokens = choice["policy_spans"][-1]["end"]
        assert rows.shape[0] == 20 + completion_tokens - 1
        assert choice["route_spans"] == [
            {"start": 0, "end": rows.shape[0], "slot": None, "version": 0}
        ]
        assert "routed_experts" not in choice
        # the prompt rows are the same forward for every child
        np.testing.assert_array_equal(rows[:19], routed.routes[0][:19])


def test_chat_completions_carry_routes(server, moe_model):
    routed = _routed(
        server,
        moe_model,
        path="/art/v1/chat/completions",
        messages=[{"role": "user", "content": "hello routes"}],
        max_tokens=5,
    )
    choice = routed.completion["choices"][0]
    assert routed.routes[0].shape[0] == choice["routes"]["prompt_tokens"] + 5 - 1


def test_stock_base64_field_holds_the_same_routes(server, moe_model):
    prompt = _prompt(8, 24)
    routed = _routed(server, moe_model, prompt=prompt, max_tokens=5)
    stock = httpx.post(
        server.url + "/v1/completions",
        json={"model": moe_model, "prompt": prompt, "max_tokens": 5, "temperature": 0},
        timeout=300,
    ).json()
    npy = np.load(io.BytesIO(base64.b64decode(stock["choices"][0]["routed_experts"])))
    np.testing.assert_array_equal(npy, routed.routes[0])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"stream": True}, "'stream': true cannot be combined with 'return_routes'"),
        ({"routes_prompt_start": -1}, "'routes_prompt_start' must be an integer >= 0"),
        ({"return_routes": "yes"}, "'return_routes' must be true or false"),
    ],
)
def test_bad_route_requests_are_refused_with_the_reason(server, moe_model, extra, message):
    body = {"model": moe_model, "prompt": [5, 6, 7], "max_tokens": 2, "return_routes": True}
    resp = httpx.post(server.url + "/art/v1/completions", json={**body, **extra}, timeout=60)
    assert resp.status_code == 400
    assert message in resp.json()["error"]["message"]


def test_response_over_the_size_limit_is_413_naming_the_limit(server, moe_model):
    resp = httpx.post(
        server.url + "/art/v1/completions",
        json={
            "model": moe_model,
            # 16 choices of at least 300 route rows of 2 MoE layers x top-2 (uint8) are over
            # MAX_BODY from their prompts alone: a few tokens each (200 before: 25x the steps)
            "prompt": _prompt(9, 300),
            "max_tokens": 8,
            "n": 16,
            "ignore_eos": True,
            "return_routes": True,
        },
        timeout=300,
    )
    assert resp.status_code == 413
    assert f"limit of {MAX_BODY} bytes" in resp.json()["error"]["message"]
    # the server keeps serving
    assert _routed(server, moe_model, prompt=[5, 6, 7], max_tokens=2).routes[0].shape[0] == 4
