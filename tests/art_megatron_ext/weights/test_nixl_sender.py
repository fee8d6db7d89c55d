"""The trainer end of `art_nixl` where trainers run it (marked `gpu` for the cuda case): a real
Megatron GPT's stream (`stream_hf_weights`) through `NixlWeightSender`'s registered buckets
(GPU memory on CUDA, host memory on CPU) to a reader process on the same device
(`nixl_reader.py`, written from the wire's rules), with NIXL (`nixl-cu13` beside the train
env's CUDA 13 torch).

Checked: the reader's tensors are the stream's bitwise (the receipt's digest, computed by the
Megatron stream itself, equals the digest of what the reader read), the end record's digest,
which the sender computes from host bytes it owns (the bucket on CPU, a pinned host copy of it
on CUDA: never `.numpy()` of a device tensor), is that digest too; the stream took several
buckets; and `close()` releases the registration. CPU twin in CI, the cuda case in the GPU
check.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.devices import cpu_and_cuda
from support.gpt_shapes import TINY

pytestmark = pytest.mark.train

READER = Path(__file__).with_name("nixl_reader.py")
REPO = Path(__file__).resolve().parents[3]
BUCKET = 64 * 1024


class OneReader:
    """Plays the server for the sender: the join starts the reader process; the update hands
    it the plan and answers once it read the stream."""

    def __init__(self, device: str, out: Path):
        self.device, self.out = device, out
        self.proc = None
        self.store = None

    def init_weight_transfer(self, init_info: dict, *, timeout: float) -> dict:
        port = init_info["master_port"]
        self.store = torch.distributed.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout)
        )
        cmd = [sys.executable, str(READER), "--port", str(port), "--rank", "1", "--workers", "1"]
        cmd += ["--device", self.device, "--out", str(self.out)]
        env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env)
        self.store.wait(["test/joined/1"])
        return {}

    def update_weights_stream(self, plan, version: int, **_) -> dict:
        self.store.set("test/job", json.dumps(plan.to_json()).encode())
        assert self.proc.wait(timeout=300) == 0
        return {"version": version}


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_a_megatron_stream_reaches_a_reader_through_registered_buckets(device, tmp_path):
    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt
    from art_megatron_ext.weights import NixlWeightSender, stream_hf_weights

    if device == "cuda":
        from support.cuda_world import nccl_world_of_one

        world = nccl_world_of_one("art_nixl_gpu_")
    else:
        from support.megatron_cpu import gloo_world_of_one

        world = gloo_world_of_one()
    reader = OneReader(device, tmp_path / "read.pt")
    sender = NixlWeightSender.connect(
        reader, workers=1, bucket_bytes=BUCKET, device=device, timeout_s=120
    )
    assert all(b.device.type == device for b in sender.buckets.buffers)
    shape = GptShape(**TINY)
    with world:
        torch.manual_seed(0)
        model = build_gpt(shape).to(device)
        plan, receipts = [], []
        stream_hf_weights(model, shape, lambda n, t: plan.append((n, t.dtype, tuple(t.shape))))
        answer = sender.send(
            3, plan, lambda sink: receipts.append(stream_hf_weights(model, shape, sink))
        )
    assert answer == {"version": 3}
    read = torch.load(tmp_path / "read.pt")
    assert len(read["tensors"]) == receipts[0].tensors == len(plan)
    assert read["digest"] == receipts[0].digest == read["end"]
    assert read["buckets"] >= receipts[0].bytes // BUCKET
    sender.close()
    assert sender._registered is None
