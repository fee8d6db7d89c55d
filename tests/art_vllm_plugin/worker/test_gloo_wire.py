"""The `art_gloo` wire (`art_protocol.weight_transfer`) between the trainer's sender
(`art_megatron_ext.weights.GlooWeightSender`) and a worker's receiver
(`art_vllm_plugin.worker.gloo_transfer.receive_stream`), on a real gloo group of three ranks
in threads (the trainer and two workers). The server around them is tested end to end in
tests/art_vllm_plugin/test_streamed_weight_update.py; here the cases a correct sender never
produces (a corrupted digest, a tensor left out) are made to happen.
"""

from __future__ import annotations

import datetime
import threading

import pytest
import torch

from art_megatron_ext.weights.gloo_sender import GlooWeightSender
from art_protocol.weight_transfer import DIGEST_BYTES, END, GROUP_PREFIX, TransferPlan
from art_protocol.weights_digest import WeightsDigest
from art_vllm_plugin.worker.gloo_transfer import GlooUpdateInfo, StreamRefused, receive_stream

WORKERS = 2
TIMEOUT = datetime.timedelta(seconds=60)

TENSORS = {
    "model.embed_tokens.weight": torch.randn(8, 4),
    "model.layers.0.mlp.down_proj.weight": torch.randn(4, 6),
    "model.norm.weight": torch.ones(4, dtype=torch.bfloat16),
    "lm_head.bias": torch.zeros(0),
}


def plan_of(tensors: dict) -> TransferPlan:
    return TransferPlan.of(
        "r1", [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()]
    )


def digest_of(tensors: dict) -> str:
    d = WeightsDigest()
    for name, t in tensors.items():
        t = t.contiguous()
        d.update(
            name, str(t.dtype), tuple(t.shape), t.view(torch.uint8).numpy() if t.numel() else b""
        )
    return d.hexdigest()


def run(send, plan: TransferPlan, request_digest: str | None = None) -> list:
    """`send(sender)` on rank 0, `receive_stream` on ranks 1..WORKERS; each worker's
    (digest or exception, {name: tensor})."""
    store = torch.distributed.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT
    )
    world = WORKERS + 1
    results: list = [None] * world
    info = GlooUpdateInfo(
        list(plan.names),
        list(plan.dtypes),
        [list(s) for s in plan.shapes],
        plan.round,
        request_digest,
    )

    def group(rank: int, own_store):
        prefixed = torch.distributed.PrefixStore(GROUP_PREFIX, own_store)
        return torch.distributed.ProcessGroupGloo(prefixed, rank, world, TIMEOUT)

    def worker(rank: int):
        # a store client of its own, as a worker process has (one client blocks while it waits)
        own = torch.distributed.TCPStore("127.0.0.1", store.port, is_master=False, timeout=TIMEOUT)
        got: dict = {}
        try:
            outcome = receive_stream(group(rank, own), own, rank, info, got.__setitem__)
        except StreamRefused as exc:
            outcome = exc
        results[rank] = (outcome, got)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(1, world)]
    for t in threads:
        t.start()
    sender = GlooWeightSender(client=None, store=store, group=group(0, store), world_size=world)
    send(sender)
    for t in threads:
        t.join(60)
    return results[1:]


def test_tensors_in_any_order_arrive_whole_with_the_digest_of_the_set():
    plan = plan_of(TENSORS)

    def send(sender):
        sender._stream(plan, lambda sink: [sink(n, TENSORS[n]) for n in reversed(plan.names)])

    for digest, got in run(send, plan, request_digest=digest_of(TENSORS)):
        assert digest == digest_of(TENSORS)
        assert set(got) == set(TENSORS)
        for name, t in TENSORS.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t)


def _raw(sender, plan: TransferPlan, names: list[str], tail: str) -> None:
    """Send `names` as a correct sender would, then `tail` as the stream's digest."""
    header = torch.empty(1, dtype=torch.int64)
    for name in names:
        header[0] = plan.names.index(name)
        sender_broadcast(sender, header)
        sender_broadcast(sender, TENSORS[name].contiguous())
    header[0] = END
    sender_broadcast(sender, header)
    sender_broadcast(
        sender, torch.tensor(list(tail.encode().ljust(DIGEST_BYTES)), dtype=torch.uint8)
    )


def sender_broadcast(sender, tensor):
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    sender.group.broadcast([tensor], options).wait()


def test_a_digest_that_is_not_the_one_of_what_arrived_is_refused():
    plan = plan_of(TENSORS)
    names = list(plan.names)
    for outcome, _ in run(lambda s: _raw(s, plan, names, "xxh3-128:" + "0" * 32), plan):
        assert isinstance(outcome, StreamRefused)
        assert f"the digest of what arrived ({digest_of(TENSORS)}) is not the one sent" in str(
            outcome
        )


def test_a_tensor_left_out_is_refused_by_name():
    plan = plan_of(TENSORS)
    sent = {n: TENSORS[n] for n in plan.names if n != "model.norm.weight"}
    for outcome, _ in run(lambda s: _raw(s, plan, list(sent), digest_of(sent)), plan):
        assert isinstance(outcome, StreamRefused)
        assert "model.norm.weight: not sent" in str(outcome)


def test_a_nan_and_a_request_digest_that_differs_are_refused_after_the_whole_stream():
    bad = dict(TENSORS)
    bad["model.embed_tokens.weight"] = bad["model.embed_tokens.weight"].clone()
    bad["model.embed_tokens.weight"][0, 0] = float("inf")
    plan = plan_of(bad)
    for outcome, got in run(
        lambda s: s._stream(plan, lambda sink: [sink(n, bad[n]) for n in plan.names]),
        plan,
        request_digest="xxh3-128:" + "1" * 32,
    ):
        assert isinstance(outcome, StreamRefused)
        assert "model.embed_tokens.weight: holds NaN or infinite values" in str(outcome)
        assert "is not the request's xxh3-128:" + "1" * 32 in str(outcome)
        assert set(got) == set(bad)  # read to its end: trainer and workers stay in step


def test_the_sender_refuses_a_tensor_the_plan_does_not_have_before_sending_it():
    plan = plan_of(TENSORS)
    sender = GlooWeightSender(client=None, store=None, group=None, world_size=1)
    with pytest.raises(ValueError, match=r"'extra\.weight' is not in the plan"):
        sender._stream(plan, lambda sink: sink("extra.weight", torch.zeros(2)))
    with pytest.raises(
        ValueError, match=r"model.norm.weight: float32 \[4\], the plan says bfloat16"
    ):
        sender._stream(plan, lambda sink: sink("model.norm.weight", torch.ones(4)))
