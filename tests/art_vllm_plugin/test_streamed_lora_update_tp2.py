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

import functools

import pytest
from support.adapter_stream import LONG, STEPS_BEFORE_UPDATE, Adapter, stream, stream_mid_generation
from support.greedy import greedy_tokens

from art_megatron_ext.weights import NixlWeightSender
from art_protocol.client import ArtClient

pytestmark = pytest.mark.serve

#: Workers of the tp2 server: one engine of two workers.
WORKERS = 2
BUCKET_BYTES = 16 * 1024


def test_a_streamed_adapter_mid_generation_on_two_tensor_parallel_workers(
    tp2_server, tiny_adapters
):
    url = tp2_server.url
    start = tp2_server.start_versions["policy"]
    a_tokens, b_tokens = greedy_tokens(url, "policy", LONG), greedy_tokens(url, "ref_b", LONG)
    assert a_tokens != b_tokens
    client = ArtClient(url, timeout=600)
    sender = NixlWeightSender.connect(
        client, workers=WORKERS, bucket_bytes=BUCKET_BYTES, timeout_s=120
    )
    try:
        b = Adapter(tiny_adapters / "b")
        choice, upd, k = stream_mid_generation(
            url, functools.partial(stream, sender, "policy", start + 1, b)
        )
    finally:
        sender.close()
        client.close()
    assert STEPS_BEFORE_UPDATE <= k < LONG
    assert choice["policy_spans"] == [
        {"start": 0, "end": k, "slot": "policy", "version": start},
        {"start": k, "end": LONG, "slot": "policy", "version": start + 1},
    ]
    assert choice["token_ids"][:k] == a_tokens[:k]
    (receipt,) = upd["receipts"]
    assert receipt["version"] == start + 1 and receipt["workers"] == list(range(WORKERS))
    assert greedy_tokens(url, "policy", LONG) == b_tokens
