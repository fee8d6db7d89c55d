"""A weight stream through a few fixed buffers arrives whole, and no buffer is overwritten
before the transport let it go (marked `gpu` for the cuda case).

The trainer end of a link-speed transport packs the stream into `count` buffers of
`bucket_bytes` (registered once) and fills one while the previous one moves (`Buckets`); the
receiving end rebuilds the tensors (`Reassembler`). Checked: every tensor comes back bitwise
with its name, dtype and shape (bf16 and fp32, a 0-d tensor, an empty one, tensors larger than
a whole bucket that continue across several), a buffer is written again only after the
handle of its last send was waited on, only `count` buffers ever exist, and the stream of a
real Megatron GPT (`stream_hf_weights`) through 4 KiB buckets gives the receipt's digest.
CPU twin in CI; the cuda case (buffers in GPU memory, copies on a side stream) in the GPU check.
"""

from __future__ import annotations

import pytest
import torch
from support.devices import cpu_and_cuda
from support.gpt_shapes import TINY

from art_protocol.weights_digest import WeightsDigest

pytestmark = pytest.mark.train


class _Transport:
    """Moves a bucket to the receiver when its handle is waited on, as an asynchronous
    transport would, and checks no buffer is written while a send of it is pending."""

    def __init__(self, buckets, receiver):
        self.buckets, self.receiver = buckets, receiver
        self.pending: dict[int, tuple] = {}
        self.got: dict[str, torch.Tensor] = {}
        self.sends = 0

    def send(self, index, bucket, entries):
        assert index not in self.pending, f"buffer {index} sent again before it was released"
        assert bucket.data_ptr() == self.buckets.buffers[index].data_ptr()
        self.pending[index] = (bucket.clone(), list(entries))
        self.sends += 1
        transport = self

        class Handle:
            def wait(self):
                if index in transport.pending:
                    data, ents = transport.pending.pop(index)
                    for name, tensor in transport.receiver.add(data, ents):
                        transport.got[name] = tensor

        return Handle()


def _tensors(device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    out = {
        "big.bf16": torch.randn(3000, generator=g).to(torch.bfloat16),  # 6000 B: 3+ buckets
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "small.f32": torch.randn(7, 3, generator=g),
        "mid.bf16": torch.randn(40, 9, generator=g).to(torch.bfloat16),
    }
    return {n: t.to(device) for n, t in out.items()}


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("count", [1, 2, 3])
def test_every_tensor_arrives_whole_and_no_buffer_is_overwritten_in_flight(device, count):
    from art_megatron_ext.weights.buckets import Buckets, Reassembler

    buckets = Buckets(1536, count=count, device=device)
    transport = _Transport(buckets, Reassembler(device))
    want = _tensors(device)
    sent = buckets.stream(lambda sink: [sink(n, t) for n, t in want.items()], transport.send)
    transport.receiver.check_complete()
    assert transport.pending == {}  # every send was waited on before stream() returned
    assert sent == transport.sends >= 6000 // 1536 + 1
    assert len(buckets.buffers) == count
    assert sorted(transport.got) == sorted(want)
    for name, tensor in want.items():
        got = transport.got[name]
        assert (got.dtype, got.shape, got.device.type) == (tensor.dtype, tensor.shape, device)
        assert torch.equal(got.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))


def test_a_bad_bucket_or_a_pinned_device_buffer_is_refused():
    from art_megatron_ext.weights.buckets import Buckets

    with pytest.raises(ValueError, match="bucket_bytes >= 1"):
        Buckets(0)
    with pytest.raises(ValueError, match="pin=True is for host buffers"):
        Buckets(64, device="meta", pin=True)


def test_a_reassembler_refuses_bytes_out_of_order():
    from art_megatron_ext.weights.buckets import BucketEntry, Reassembler

    entry = BucketEntry("w", torch.float32, (4,), 16, 8, 0, 8)
    with pytest.raises(ValueError, match="out of order"):
        list(Reassembler().add(torch.zeros(8, dtype=torch.uint8), [entry]))


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_a_megatron_stream_through_small_buckets_gives_the_receipts_digest(device):
    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt
    from art_megatron_ext.weights import stream_hf_weights
    from art_megatron_ext.weights.buckets import Buckets, Reassembler

    if device == "cuda":
        from support.cuda_world import nccl_world_of_one

        world = nccl_world_of_one("art_buckets_gpu_")
    else:
        from support.megatron_cpu import gloo_world_of_one

        world = gloo_world_of_one()
    shape = GptShape(**TINY)
    buckets = Buckets(4096, count=2, device=device)
    transport = _Transport(buckets, Reassembler("cpu"))
    with world:
        torch.manual_seed(0)
        model = build_gpt(shape).to(device)
        receipts = []
        buckets.stream(
            lambda sink: receipts.append(stream_hf_weights(model, shape, sink)), transport.send
        )
    digest = WeightsDigest()
    for name, t in transport.got.items():
        digest.update(name, str(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy())
    assert digest.tensors == receipts[0].tensors
    assert digest.hexdigest() == receipts[0].digest
