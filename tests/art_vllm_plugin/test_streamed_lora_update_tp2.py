"""A streamed LoRA update (`transfer`) on an engine of two tensor-parallel workers.

The server: the shared `tp2` server (one engine, `-tp 2`, float32, `art_nixl`, slots `policy`
(adapter a) and `ref_b` (adapter b)). What differs from one worker per engine
(test_streamed_lora_update.py, the dp2 server): an engine of several workers receives a stream
between steps, inside the ride every worker runs at the same step (`worker/adapter_receive.py`,
as a full-weight stream), so the engine's steps wait for the stream, and worker 0 writes the
file while worker 1 drops what arrived.

Checked: adapter b streamed into `policy` in the middle of a generation: the tokens before the
update are a's greedy tokens, the spans switch version at the update's step, and `policy` then
gives b's greedy tokens (`ref_b` serves b from its files); both workers staged and committed
(the receipt names them).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from support.adapter_stream import Adapter, stream
from support.step_hold import update_after_steps

from art_megatron_ext.weights import NixlWeightSender
from art_protocol.client import ArtClient

pytestmark = pytest.mark.serve

#: Workers of the tp2 server: one engine of two workers.
WORKERS = 2
BUCKET_BYTES = 16 * 1024
PROMPT = "the policy model learns from the reward and the trainer sends"
LONG = 48
STEPS_BEFORE_UPDATE = 8


def completion_body(model: str) -> dict:
    return {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": LONG,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


def greedy(url: str, model: str) -> list[int]:
    resp = httpx.post(url + "/v1/completions", json=completion_body(model), timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


def test_a_streamed_adapter_mid_generation_on_two_tensor_parallel_workers(
    tp2_server, tiny_adapters
):
    url = tp2_server.url
    start = tp2_server.start_versions["policy"]
    a_tokens, b_tokens = greedy(url, "policy"), greedy(url, "ref_b")
    assert a_tokens != b_tokens
    client = ArtClient(url, timeout=600)
    sender = NixlWeightSender.connect(
        client, workers=WORKERS, bucket_bytes=BUCKET_BYTES, timeout_s=120
    )
    try:

        async def run():
            async with httpx.AsyncClient(base_url=url, timeout=300) as http:
                return await update_after_steps(
                    http,
                    lambda: http.post("/v1/completions", json=completion_body("policy")),
                    STEPS_BEFORE_UPDATE,
                    lambda: stream(sender, "policy", start + 1, Adapter(tiny_adapters / "b")),
                )

        resp, upd, s0 = asyncio.run(run())
    finally:
        sender.close()
        client.close()
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    k = upd["step"] - s0
    assert STEPS_BEFORE_UPDATE <= k < LONG
    assert choice["policy_spans"] == [
        {"start": 0, "end": k, "slot": "policy", "version": start},
        {"start": k, "end": LONG, "slot": "policy", "version": start + 1},
    ]
    assert choice["token_ids"][:k] == a_tokens[:k]
    (receipt,) = upd["receipts"]
    assert receipt["version"] == start + 1 and receipt["workers"] == list(range(WORKERS))
    assert greedy(url, "policy") == b_tokens
