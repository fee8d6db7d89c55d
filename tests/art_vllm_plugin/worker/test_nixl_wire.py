"""The `art_nixl` wire (`art_protocol.weight_transfer`, section `art_nixl`) between the
trainer's sender (`art_megatron_ext.weights.NixlWeightSender`, in this process) and two
workers' receivers (`art_vllm_plugin.worker.nixl_receiver`, each in a process of its own,
`nixl_wire_worker.py`), with real NIXL agents (UCX) reading the trainer's registered buffers.
The server around them is tested end to end on the shared dp2 and tp2 servers
(test_streamed_weight_update.py, worker/test_shard_staging.py); here the trainer's side of
the server (`LocalWorkers`: what `POST /art/v1/weights/transfer/init` and the update's POST
make the workers do) is played by the test, so the cases a correct sender never produces (a
corrupted digest, a tensor left out) and a trainer that stalls can be made to happen.

Checked: tensors sent in any order through 1 KiB buckets (one tensor spread over several)
arrive bitwise with the digest of the set; a producer that strays from the plan gives every
worker the trainer's reason at once (not at its deadline); a trainer that stalls trips the
workers' stall deadline, which names the round and the bytes received, and the trainer then
stops too, naming it; a NaN, a request digest that differs, a stream digest that is not the
one of what arrived, and a tensor left out are refused.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from art_megatron_ext.weights import NixlWeightSender
from art_megatron_ext.weights.stream_sender import make_plan
from art_protocol import nixl_wire as wire
from art_protocol.weights_digest import WeightsDigest

WORKERS = 2
BUCKET = 1024
WORKER = Path(__file__).with_name("nixl_wire_worker.py")
REPO = Path(__file__).resolve().parents[3]

TENSORS = {
    "model.embed_tokens.weight": torch.randn(100, 8),  # 3200 bytes: four buckets
    "model.layers.0.mlp.down_proj.weight": torch.randn(4, 6),
    "model.norm.weight": torch.ones(4, dtype=torch.bfloat16),
    "model.layers.0.scale": torch.tensor(0.5),
    "lm_head.bias": torch.zeros(0),
}


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def digest_of(tensors: dict) -> str:
    d = WeightsDigest()
    for name, t in tensors.items():
        d.update(name, str(t.dtype), tuple(t.shape), as_bytes(t).numpy())
    return d.hexdigest()


def plan_of(tensors: dict) -> list[tuple]:
    return [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]


class LocalWorkers:
    """Plays the server for the sender: `init_weight_transfer` starts the worker processes
    (they join: agent, trainer's agent, receive buffer), `update_weights_stream` has each of
    them receive one stream and answers with what each got."""

    def __init__(self, out: Path):
        self.out = out
        self.procs: list[subprocess.Popen] = []
        self.store = None
        self.jobs = 0
        self.results: list[dict] = []
        #: the workers' stall deadline for the next streams (None: init_info's)
        self.stall_s: float | None = None

    def init_weight_transfer(self, init_info: dict, *, timeout: float) -> dict:
        port = init_info["master_port"]
        self.store = torch.distributed.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout)
        )
        env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
        for rank in range(1, init_info["world_size"]):
            cmd = [sys.executable, str(WORKER), "--port", str(port), "--rank", str(rank)]
            cmd += ["--workers", str(init_info["world_size"] - 1)]
            cmd += ["--stall", str(init_info["stall_timeout_s"]), "--out", str(self.out)]
            self.procs.append(subprocess.Popen(cmd, cwd=REPO, env=env))
        self.store.wait([f"test/joined/{r}" for r in range(1, init_info["world_size"])])
        return {}

    def update_weights_stream(self, plan, version: int, *, digest=None, timeout=None, **_):
        k, self.jobs = self.jobs, self.jobs + 1
        self.last_round = plan.round
        job = {"plan": plan.to_json(), "digest": digest, "stall_s": self.stall_s}
        self.store.set(f"test/job/{k}", json.dumps(job).encode())
        keys = [f"test/result/{k}/{r}" for r in range(1, len(self.procs) + 1)]
        self.store.wait(keys)
        self.results = [json.loads(self.store.get(key)) for key in keys]
        self.received = [torch.load(self.out / f"{k}-{r}.pt") for r in range(1, WORKERS + 1)]
        return {"version": version}

    def close(self) -> None:
        if self.store is not None:
            self.store.set(f"test/job/{self.jobs}", b'{"stop": true}')
        for proc in self.procs:
            proc.wait(timeout=60)
        assert all(p.returncode == 0 for p in self.procs), [p.returncode for p in self.procs]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    workers = LocalWorkers(tmp_path_factory.mktemp("nixl"))
    sender = NixlWeightSender.connect(
        workers, workers=WORKERS, bucket_bytes=BUCKET, timeout_s=120, stall_timeout_s=60.0
    )
    yield workers, sender
    workers.close()  # while the trainer's store still serves them
    sender.close()


def test_tensors_in_any_order_arrive_whole_through_small_buckets(pair):
    workers, sender = pair
    order = list(reversed(TENSORS))
    assert sender.send(7, plan_of(TENSORS), lambda sink: [sink(n, TENSORS[n]) for n in order]) == {
        "version": 7
    }
    assert workers.results == [{"digest": digest_of(TENSORS)}] * WORKERS
    for got in workers.received:
        assert set(got) == set(TENSORS)
        for name, t in TENSORS.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape
            assert torch.equal(as_bytes(got[name]), as_bytes(t))


def test_a_produce_that_strays_from_the_plan_gives_the_workers_its_reason_at_once(pair):
    workers, sender = pair

    def produce(sink):
        sink("model.embed_tokens.weight", TENSORS["model.embed_tokens.weight"])
        sink("extra.weight", torch.zeros(2))

    start = time.monotonic()
    with pytest.raises(ValueError, match=r"'extra\.weight' is not in the plan"):
        sender.send(8, plan_of(TENSORS), produce)
    assert time.monotonic() - start < 30  # the workers' deadline is 60 s
    for result in workers.results:
        assert result["error"] == "StreamRefused", result
        assert "the trainer ended round" in result["message"]
        assert "'extra.weight' is not in the plan" in result["message"]


def test_a_nan_and_a_request_digest_that_differs_are_refused_after_the_whole_stream(pair):
    workers, sender = pair
    bad = dict(TENSORS)
    bad["model.embed_tokens.weight"] = bad["model.embed_tokens.weight"].clone()
    bad["model.embed_tokens.weight"][50, 0] = float("nan")
    other = "xxh3-128:" + "1" * 32
    sender.send(9, plan_of(bad), lambda sink: [sink(n, t) for n, t in bad.items()], digest=other)
    for result, got in zip(workers.results, workers.received, strict=True):
        assert result["error"] == "StreamRefused", result
        assert "model.embed_tokens.weight: holds NaN or infinite values" in result["message"]
        assert f"is not the request's {other}" in result["message"]
        assert set(got) == set(bad)  # read to its end


def _raw_round(sender, workers, tensors: dict, sent: list[str], end_digest: str) -> list[dict]:
    """One round whose records are written here: `sent` packed into buffer 0 as one bucket,
    then an end record carrying `end_digest`."""
    plan = make_plan(plan_of(tensors))
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(workers.update_weights_stream, plan, 1)
        sender._wait_ready(plan, answer, 60)
        buffer, used, entries = sender.buckets.buffers[0], 0, []
        for name in sent:
            data = as_bytes(tensors[name])
            buffer[used : used + data.numel()] = data
            entries.append(wire.Entry(plan.names.index(name), 0, used, data.numel()))
            used += data.numel()
        sender.store.set(
            wire.bucket_key(plan.round, 0), wire.encode(wire.Bucket(0, used, tuple(entries)))
        )
        sender.store.wait([wire.all_pulled_key(plan.round, 0)])
        sender.store.set(wire.bucket_key(plan.round, 1), wire.encode(wire.End(end_digest)))
        answer.result(60)
    return workers.results


def test_a_stream_digest_that_is_not_the_one_of_what_arrived_is_refused(pair):
    workers, sender = pair
    small = {n: t for n, t in TENSORS.items() if t.nbytes < BUCKET // 4}
    for result in _raw_round(sender, workers, small, list(small), "xxh3-128:" + "0" * 32):
        assert result["error"] == "StreamRefused", result
        assert (
            f"the digest of what arrived ({digest_of(small)}) is not the one sent"
            in (result["message"])
        )


def test_a_tensor_left_out_is_refused_by_name(pair):
    workers, sender = pair
    small = {n: t for n, t in TENSORS.items() if t.nbytes < BUCKET // 4}
    sent = [n for n in small if n != "model.norm.weight"]
    end = digest_of({n: small[n] for n in sent})
    for result in _raw_round(sender, workers, small, sent, end):
        assert result["error"] == "StreamRefused", result
        assert "model.norm.weight: not sent" in result["message"]


def test_a_stalled_trainer_trips_the_workers_deadline_naming_the_bytes_received(pair):
    workers, sender = pair
    big = torch.randn(384)  # 1536 bytes: bucket 0 goes out full, the rest waits for the stall

    def produce(sink):
        sink("w", big)
        time.sleep(6)

    workers.stall_s = 2.0  # the workers' deadline for this stream (init_info's is 60 s)
    try:
        with pytest.raises(RuntimeError, match="a worker stopped reading") as stopped:
            sender.send(1, [("w", big.dtype, big.shape)], produce)
    finally:
        workers.stall_s = None
    assert "no bucket from the trainer for 2.0 s" in str(stopped.value)
    for result, got in zip(workers.results, workers.received, strict=True):
        assert result["error"] == "StreamStalled", result
        assert "after 1 buckets, 1024 bytes received" in result["message"]
        assert f"round {workers.last_round}" in result["message"] and got == {}
    # the workers' store connections survived the stall: the next stream goes through
    test_tensors_in_any_order_arrive_whole_through_small_buckets(pair)
