"""Full-weight updates streamed from the trainer (`transfer`, no files) on two DP engines.

The server: the shared `dp2` server (tests/support/server_kinds.py), which runs vLLM's
weight-transfer machinery with this plugin's `art_nixl` engine (`--weight-transfer-config
'{"backend": "art_nixl"}'`, registered with vLLM's factory). The test process is the
trainer: `NixlWeightSender` (art_megatron_ext.weights) registers its buckets (96 KiB here, so
the larger tensors cross bucket boundaries) with a NIXL agent, every worker of both engines
joins through `POST /art/v1/weights/transfer/init` (its own agent and receive buffer), and
each update is one request plus the stream, which every worker reads out of the trainer's
buckets. art_gloo keeps its own tests (worker/test_gloo_wire.py, test_two_hosts.py, the
example loop). The weights are the tiny model's with noise (the same export a files update
would read), so what the engines compute is checked against Hugging Face transformers on
that checkpoint, in float32.

Checked:
- a streamed update in the middle of a generation: tokens before it are the old weights'
  greedy tokens, the spans switch base version at the update's step, both engines commit
  (a receipt each, with the digest of the set of tensors, equal to the checkpoint's), and
  requests on either engine then give the new weights' greedy tokens; the tensors were sent
  in reverse order (the wire names each tensor's place in the plan);
- a plan that does not fit the served model is refused (422) before a byte is sent, and the
  group still serves the next update;
- a stream with a NaN, or whose digest is not the request's, is refused (422) after it was
  received, and the engines keep the old weights;
- a stale version is refused (409) before anything is sent, and a retried operation id is
  answered from the first answer (`replayed`) before anything is sent;
- a files update after a streamed one whose commit fails on engine 1 puts engine 0 back on
  the streamed weights (which only the workers' host memory holds);
- a LoRA update of a slot stages and commits on both engines while every worker waits for a
  stream's bytes (the stream has a receiving thread of its own).

Runs after every other module of the server (`changes_base_weights`): it moves the base
weights, as test_full_weight_update does.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import httpx
import pytest
import torch
from safetensors.torch import load_file
from support.full_weights import (
    LONG,
    SHORT,
    STEPS_BEFORE_UPDATE,
    Server,
    base_versions,
    export,
    generate_across_update,
    hf_greedy,
    prompt_ids,
    tokens,
    update,
)

from art_megatron_ext.weights import NixlWeightSender
from art_protocol.client import ArtClient, ArtError
from art_protocol.spans import validate_spans
from art_protocol.weights_digest import digest_checkpoint

pytestmark = [pytest.mark.serve, pytest.mark.changes_base_weights]

#: Workers of the dp2 server: two engines of one worker each.
WORKERS = 2
#: The trainer's buckets: the embedding and lm_head (139,520 bytes each) cross a boundary.
BUCKET_BYTES = 96 * 1024


@pytest.fixture(scope="module")
def server(dp2_server, tiny_model):
    """The shared dp2 server, as one of the last modules on it (`changes_base_weights`)."""
    return Server(dp2_server, dp2_server.scratch, tiny_model)


@pytest.fixture(scope="module")
def sender(server):
    """The trainer's end; every worker of both engines joined it."""
    client = ArtClient(server.url, timeout=600)
    sender = NixlWeightSender.connect(
        client, workers=WORKERS, bucket_bytes=BUCKET_BYTES, timeout_s=120
    )
    yield sender
    sender.close()
    client.close()


def tensors_of(model_dir) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def plan_of(tensors: dict[str, torch.Tensor]) -> list[tuple]:
    return [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]


def stream(sender, version: int, tensors: dict, plan=None, **kw) -> dict:
    """Publish `tensors` as `version`, sending them in reverse name order."""

    def produce(sink):
        for name in sorted(tensors, reverse=True):
            sink(name, tensors[name])

    return sender.send(version, plan or plan_of(tensors), produce, **kw)


def test_a_streamed_update_mid_generation_switches_both_engines(server, sender):
    start = base_versions(server)
    assert start[0] == start[1]
    new_dir = export(server, "streamed", noise=0.05, seed=11)
    ids = prompt_ids(server)
    old = tokens(server, 0, max_tokens=LONG)
    new_ref = hf_greedy(new_dir, ids, SHORT)
    version = server.version()
    new = tensors_of(new_dir)
    resp, upd, s0 = generate_across_update(server, lambda: stream(sender, version, new))
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    spans = validate_spans(choice, LONG, latest_version=0, latest_base_version=version)
    assert [(s["slot"], s["version"], s.get("base_version", 0)) for s in spans] == [
        (None, 0, start[0]),
        (None, 0, version),
    ]
    k = spans[0]["end"]
    assert STEPS_BEFORE_UPDATE <= k < LONG and k == upd["step"] - s0
    assert choice["token_ids"][:k] == old[:k]
    assert upd["version"] == version and upd["previous_version"] == start[0]
    # the digest of what the workers received is the checkpoint's: the same set of tensors
    assert upd["digest"] == digest_checkpoint(new_dir).hexdigest()
    assert sorted(r["engine"] for r in upd["receipts"]) == [0, 1]
    assert base_versions(server) == [version, version]
    assert tokens(server, 0) == new_ref and tokens(server, 1) == new_ref


def test_a_plan_that_does_not_fit_is_refused_before_anything_is_sent(server, sender):
    before, old = base_versions(server), tokens(server, 0)
    weights = tensors_of(export(server, "short-plan", noise=0.05, seed=12))
    embed = "model.embed_tokens.weight"
    plan = [p for p in plan_of(weights) if p[0] != embed]
    with pytest.raises(ArtError) as refused:
        stream(sender, server.next_version, weights, plan=plan)
    assert refused.value.status == 422
    assert f"{embed}: missing from the update" in refused.value.message
    assert base_versions(server) == before and tokens(server, 0) == old
    # the group is untouched: the next stream goes through
    v = server.version()
    assert stream(sender, v, weights)["version"] == v
    assert base_versions(server) == [v, v]


def test_a_stream_with_a_nan_or_another_digest_is_refused_after_it_arrived(server, sender):
    before, old = base_versions(server), tokens(server, 0)
    weights = tensors_of(export(server, "nan", noise=0.05, seed=13))
    good_digest = digest_checkpoint(export(server, "nan-free", noise=0.05, seed=13)).hexdigest()
    bad = dict(weights)
    bad["model.norm.weight"] = bad["model.norm.weight"].clone()
    bad["model.norm.weight"][0] = float("nan")
    with pytest.raises(ArtError) as nan:
        stream(sender, server.next_version, bad)
    assert nan.value.status == 422
    assert "model.norm.weight: holds NaN or infinite values" in nan.value.message
    with pytest.raises(ArtError) as other:
        stream(sender, server.next_version, weights, digest="xxh3-128:" + "0" * 32)
    assert other.value.status == 422 and good_digest in other.value.message
    assert base_versions(server) == before and tokens(server, 0) == old


def test_a_stale_version_is_refused_before_anything_is_sent(server, sender):
    current = base_versions(server)[0]
    weights = tensors_of(server.model)
    with pytest.raises(ArtError) as stale:
        stream(sender, current, weights)
    assert stale.value.status == 409 and "not newer" in stale.value.message
    assert base_versions(server) == [current, current]


def test_a_retried_stream_is_answered_from_its_record_before_anything_is_sent(server, sender):
    """The same `operation_id` after its answer was lost: the first answer, `replayed`, and
    the producer is never called; the id with another body is refused (409), nothing sent."""
    v = server.version()
    weights = tensors_of(export(server, "retried", noise=0.05, seed=15))
    op = f"stream-retry-{v}"
    first = stream(sender, v, weights, operation_id=op)
    produced = []
    again = sender.send(v, plan_of(weights), produced.append, operation_id=op)
    assert again["replayed"] is True and not produced
    assert {k: again[k] for k in ("version", "digest", "step")} == {
        k: first[k] for k in ("version", "digest", "step")
    }
    with pytest.raises(ArtError) as reused:
        sender.send(v + 1, plan_of(weights), produced.append, operation_id=op)
    assert reused.value.status == 409 and "different body" in reused.value.message
    assert not produced and base_versions(server) == [v, v]


def test_a_failed_files_update_reverts_engine_0_to_the_streamed_weights(server, sender):
    v = server.version()
    streamed_dir = export(server, "held", noise=0.05, seed=14)
    assert stream(sender, v, tensors_of(streamed_dir))["version"] == v
    held = [tokens(server, rank) for rank in (0, 1)]
    assert held[0] == held[1] == hf_greedy(streamed_dir, prompt_ids(server), SHORT)
    armed = httpx.post(
        server.url + "/art/v1/test/fault",
        json={"kind": "commit", "rank": 0, "engine": 1},
        timeout=60,
    )
    assert armed.status_code == 200, armed.text
    nxt = server.version()
    resp = update(server, export(server, f"v{nxt}", noise=0.05, seed=nxt), nxt)
    assert resp.status_code == 500, resp.text
    assert "engines [0] reverted" in resp.json()["error"]["message"]
    assert base_versions(server) == [v, v]
    assert [tokens(server, rank) for rank in (0, 1)] == held


def test_a_lora_update_goes_through_while_the_workers_wait_for_a_stream(
    server, sender, tiny_adapters
):
    before = base_versions(server)
    v = server.version()
    weights = tensors_of(export(server, "beside-lora", noise=0.05, seed=15))
    seen = {}
    pool = ThreadPoolExecutor(1)

    def produce(sink):
        # every worker is receiving now (the sender waited for their ready keys)
        with ArtClient(server.url, timeout=120) as art:
            slot_version = art.latest_versions()["policy"]
            lora = pool.submit(art.update, "policy", str(tiny_adapters / "b"), slot_version + 1)
            try:
                seen["lora"] = lora.result(timeout=60)
            except FutureTimeout:
                seen["lora"] = None  # held behind the stream: send it, so both finish
            seen["slot_version"], seen["base"] = slot_version, base_versions(server)
        for name in sorted(weights):
            sink(name, weights[name])

    try:
        resp = sender.send(v, plan_of(weights), produce)
    finally:
        pool.shutdown(wait=True)
    assert seen["lora"] is not None, "the LoRA update waited for the stream"
    assert seen["lora"]["version"] == seen["slot_version"] + 1
    assert sorted(r["engine"] for r in seen["lora"]["receipts"]) == [0, 1]
    assert seen["base"] == before  # committed while the stream was still to come
    assert resp["version"] == v and base_versions(server) == [v, v]
