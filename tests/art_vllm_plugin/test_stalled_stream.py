"""A streamed full-weight update whose trainer stops sending is ended by its stall, not by a
fixed deadline, and shows its progress while it runs (`api_server/stage_deadline.py`,
`api_server/base_progress.py`, issue 35 item 5).

The server: the shared `tp2` server (one engine of two tensor-parallel workers, `art_nixl`),
started with the default stall window (120 s); the update request carries the test hook's
header (`routes.STALL_TEST_HEADER`, honoured with ART_TEST_HOOKS=1) for a window of
`STALL_S`. An engine of several workers receives a stream between steps, and when it is idle
(as here) inside the stage call itself: the engine answers nothing until the stream is in, so
the API server judges it by its workers' progress files alone. The test process is the
trainer (`NixlWeightSender`, whose workers wait `CEILING_S` for a bucket: longer than the
window). Its buckets hold exactly the first `SENT` tensors, and its `produce` hands over one
more (which fills the first bucket, so it is sent, and starts the second, which is not),
then waits until the test lets it go on: the stall happens at a known point, with exactly
those `SENT` tensors received by each worker.

Checked:
- while the trainer waits, `GET /art/v1/weights` answers (the engine does not: the version and
  staging figures are the last read, `engines_answered: false`) and shows the engine's bytes
  and tensors received of the update's total, per worker, and the seconds since the last;
- once nothing moved for the window, the update is answered 500 naming the engine, both
  worker ranks and the bytes each received of the total, and the flag; `progress` is null;
- once the trainer goes on, it learns the server's answer (the round ends); the next stream
  (with a NaN) is received whole and refused 422 as such; the base version and the served
  tokens are the old ones throughout.

Changes no base weights (nothing here commits) and holds nothing on the workers afterwards
(test_shard_staging, the last module on the server, counts what they hold).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from safetensors.torch import load_file
from support.full_weights import Server, tokens

from art_megatron_ext.weights import NixlWeightSender
from art_protocol.client import ArtClient, ArtError
from art_protocol.nixl_api import progress
from art_vllm_plugin.api_server.routes import STALL_TEST_HEADER

pytestmark = pytest.mark.serve

#: Workers of the tp2 server: one engine of two.
WORKERS = 2
#: The stall window of this module's updates (seconds).
STALL_S = 8.0
#: Tensors the trainer sends before it stops.
SENT = 3
#: Ceiling for what a loaded host may take (a server answer, a poll): not a timing check.
CEILING_S = 120.0


@pytest.fixture(scope="module")
def server(tp2_server, tiny_model):
    return Server(tp2_server, tp2_server.scratch, tiny_model)


def served_tensors(server) -> dict:
    return load_file(str(server.model / "model.safetensors"))


def nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


@pytest.fixture(scope="module")
def sender(server):
    """The trainer's end; its buckets hold the first `SENT` tensors (in name order) exactly,
    and its update requests carry the stall window's header."""
    tensors = served_tensors(server)
    bucket = sum(nbytes(tensors[n]) for n in sorted(tensors)[:SENT])
    client = ArtClient(server.url, timeout=600)
    client._http.headers[STALL_TEST_HEADER] = str(STALL_S)  # the client has no header option
    sender = NixlWeightSender.connect(
        client,
        workers=WORKERS,
        bucket_bytes=bucket,
        timeout_s=CEILING_S,
        stall_timeout_s=CEILING_S,
    )
    yield sender
    sender.close()
    client.close()


def plan_of(tensors: dict) -> list[tuple]:
    return [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]


def weights(server) -> dict:
    resp = httpx.get(server.url + "/art/v1/weights", timeout=CEILING_S)
    assert resp.status_code == 200, resp.text
    return resp.json()


def poll(server, done, what: str) -> dict:
    """`GET /art/v1/weights` once `done(its progress)` holds."""
    deadline, views = time.monotonic() + CEILING_S, []
    while time.monotonic() < deadline:
        seen = weights(server)
        if done(seen["progress"]):
            return seen
        if seen["progress"] not in views:
            views.append(seen["progress"])
        time.sleep(0.1)
    pytest.fail(f"{what}: not seen within {CEILING_S} s (progress seen: {views})")


def wait_for_the_test(sender, go_on: threading.Event) -> None:
    """The trainer stops sending, as one stuck computing its next layer would, but keeps its
    NIXL agent progressing (the sender does while it waits for reads): over transports where
    a one-sided read needs the target's help, the bucket it published is read meanwhile."""
    deadline = time.monotonic() + CEILING_S
    while not go_on.wait(0.005):
        progress(sender.agent)
        assert time.monotonic() < deadline, "the test never let the trainer go on"


def test_a_stalled_stream_shows_its_progress_then_ends_naming_engine_ranks_and_bytes(
    server, sender
):
    start = weights(server)
    before, old = start["version"], tokens(server, 0)
    held = [w["held_bytes"] for w in start["staging"]["engines"][0]["workers"]]
    tensors = served_tensors(server)
    names = sorted(tensors)
    total = sum(nbytes(t) for t in tensors.values())
    sent = sum(nbytes(tensors[n]) for n in names[:SENT])
    paused, go_on = threading.Event(), threading.Event()

    def produce(sink):
        for i, name in enumerate(names):
            if i == SENT + 1:  # tensor SENT filled the first bucket: it was sent
                paused.set()
                wait_for_the_test(sender, go_on)
            sink(name, tensors[name])

    with ThreadPoolExecutor(1) as pool:
        update = pool.submit(sender.send, server.next_version, plan_of(tensors), produce)
        try:
            assert paused.wait(CEILING_S)
            seen = poll(
                server,
                lambda p: p is not None and p["engines"][0]["tensors"] == SENT,
                f"the engine at {SENT} tensors",
            )
            assert seen["engines_answered"] is False and seen["version"] == before
            view = seen["progress"]
            assert view["version"] == server.next_version and view["stall_timeout_s"] == STALL_S
            (engine,) = view["engines"]
            assert (engine["engine"], engine["bytes"], engine["total_bytes"]) == (0, sent, total)
            assert engine["total_tensors"] == len(names) and 0 <= engine["idle_s"] < CEILING_S
            assert [(w["rank"], w["bytes"]) for w in engine["workers"]] == [(0, sent), (1, sent)]
            poll(server, lambda p: p is None, "the update ended")
        finally:
            go_on.set()
        with pytest.raises(ArtError) as stalled:
            update.result(timeout=CEILING_S)
    message = stalled.value.message
    assert stalled.value.status == 500, message
    worker = f"{sent} of {total} bytes and {SENT} of {len(names)} tensors"
    assert "stalled: engine 0 received nothing for " in message, message
    assert f"(worker rank 0: {worker}, worker rank 1: {worker}), past the stall window of " in (
        message
    )
    assert f"{STALL_S:g} s (--art-weights-stall-timeout)" in message
    assert message.endswith(f"the base weights keep serving version {before}"), message
    assert weights(server)["version"] == before and tokens(server, 0) == old

    # The next stream arrives whole.
    bad = dict(tensors)
    bad["model.norm.weight"] = bad["model.norm.weight"].clone()
    bad["model.norm.weight"][0] = float("nan")

    def produce_all(sink):
        for name, tensor in bad.items():
            sink(name, tensor)

    with pytest.raises(ArtError) as nan:
        sender.send(server.next_version, plan_of(bad), produce_all)
    assert nan.value.status == 422 and "model.norm.weight: holds NaN" in nan.value.message
    after = weights(server)
    assert after["version"] == before and after["progress"] is None
    assert [w["held_bytes"] for w in after["staging"]["engines"][0]["workers"]] == held
    assert tokens(server, 0) == old
