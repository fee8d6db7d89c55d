"""The trainer's end of an `art_nixl` weight transfer: full weights to every worker of every
engine at the speed of the links, from a few registered buffers.

Why: `art_gloo` moves each tensor through pageable host memory and a TCP tree, and each
worker receives the whole model. Here the trainer owns `count` buffers of `bucket_bytes`
(`Buckets`: GPU memory on a GPU, filled on a side stream; host memory on a CPU trainer),
registers them with a NIXL agent once, at `connect`, and publishes its agent's metadata and
the buffers' addresses in its store. For each filled bucket it publishes a small record
(which buffer, bytes used, which bytes of which plan tensors) and every worker READs the
bucket straight out of the trainer's buffer into its own (one-sided: the trainer's CPU does
not touch the bytes), counts itself done, and takes what its parameters hold. A buffer is
filled again only once every worker pulled it, so with two buffers the producer fills one
while the workers read the other. Wire: `art_protocol.weight_transfer` (section `art_nixl`).

`send` keeps `GlooWeightSender.send`'s contract (`stream_sender`: nothing moves before every
worker is receiving, a refusal before that is raised with nothing sent, each tensor checked
against the plan). The stream digest is computed once, here, from host bytes this object
owns: the bucket itself on a CPU trainer, a pinned host copy of it on a GPU (never `.numpy()`
of a device tensor). If `produce` raises (a tensor that strays from the plan, a failure in
the producer), an abort record naming why ends the round: the workers fail at once instead
of waiting for their deadline. `close()` releases the registration.

Needs torch and NIXL (`art_protocol.nixl_api` says how to install it); no vLLM, no Megatron.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future

import torch

from art_megatron_ext.weights.buckets import BucketEntry, Buckets
from art_megatron_ext.weights.stream_sender import (
    LOOPBACK,
    PlanCheck,
    Produce,
    StreamSender,
    join,
    open_store,
)
from art_protocol import nixl_wire as wire
from art_protocol.nixl_api import new_agent, progress
from art_protocol.weight_transfer import TransferPlan

#: The default bucket: large enough that a record per bucket costs nothing next to its bytes,
#: small enough that two of them (trainer) and one (each worker) are no memory to speak of.
DEFAULT_BUCKET_BYTES = 64 * 2**20
#: The default of how long a worker waits for the next bucket (and the trainer for every
#: worker to have read one) before it ends the stream with an error.
DEFAULT_STALL_S = 120.0


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _Pulled:
    """The handle of one published bucket: `wait()` returns once every worker read it."""

    def __init__(self, sender: NixlWeightSender, round_id: str, n: int, answer: Future | None):
        self.sender, self.round, self.n, self.answer = sender, round_id, n, answer
        self.done = False

    def wait(self) -> None:
        """Idempotent (`Buckets` waits on a buffer's last handle again at the end)."""
        if self.done:
            return
        store, workers = self.sender.store, self.sender.workers
        done = wire.all_pulled_key(self.round, self.n)
        stall = self.sender.stall_timeout_s
        deadline, delay = time.monotonic() + stall, 0.0002
        while not store.check([done]):
            progress(self.sender.agent)  # the target's part of a read, where UCX needs one
            if store.add(wire.quit_key(self.round), 0) > 0:
                raise RuntimeError(
                    f"round {self.round}: a worker stopped reading at bucket {self.n}: "
                    f"{self.sender.quit_reasons(self.round)}"
                )
            if self.answer is not None and self.answer.done():
                self.answer.result()  # raises the server's error
                raise RuntimeError(
                    f"round {self.round}: the server answered while bucket {self.n} was read"
                )
            if time.monotonic() > deadline:
                pulled = store.add(wire.pulled_key(self.round, self.n), 0)
                raise TimeoutError(
                    f"round {self.round}: bucket {self.n} read by {pulled} of {workers} workers "
                    f"after {stall} s"
                )
            time.sleep(delay)
            delay = min(2 * delay, 0.005)
        for key in (wire.bucket_key, wire.pulled_key, wire.all_pulled_key):
            store.delete_key(key(self.round, self.n))
        self.done = True


class NixlWeightSender(StreamSender):
    """The trainer's end: `connect` once (registers the buffers), `send` each version."""

    def __init__(self, client, store, workers: int, agent, buckets: Buckets, stall_timeout_s):
        super().__init__(client, store, workers)
        self.agent = agent
        self.buckets = buckets
        self.stall_timeout_s = stall_timeout_s
        self._registered = agent.register_memory(buckets.buffers)
        cuda = buckets.device.type == "cuda"
        # the digest's host bytes on a GPU trainer: one pinned copy of a bucket at a time
        self._host = (
            torch.empty(buckets.bucket_bytes, dtype=torch.uint8, pin_memory=True) if cuda else None
        )
        self._numbers: dict[str, itertools.count] = {}

    @classmethod
    def connect(
        cls,
        client,
        *,
        workers: int,
        host: str = LOOPBACK,
        port: int = 0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        count: int = 2,
        device=None,
        timeout_s: float = 600.0,
        stall_timeout_s: float = DEFAULT_STALL_S,
    ) -> NixlWeightSender:
        """Open the store on `host:port` (0: a free port; `host` an address every worker can
        reach, as for `GlooWeightSender.connect`), register `count` buffers of `bucket_bytes`
        on `device` (default: the current CUDA device, else host memory) with a NIXL agent,
        publish them, and have every worker of every engine (`workers` in all) join: each
        makes its own agent and registers one receive buffer of `bucket_bytes`.
        `stall_timeout_s`: how long a worker waits for the next bucket, and the trainer for
        every worker to read one, before the round ends with an error."""
        store = open_store(host, port, timeout_s)
        device = torch.device(device) if device is not None else _default_device()
        buckets = Buckets(bucket_bytes, count=count, device=device)
        agent = new_agent(f"art-trainer-{uuid.uuid4().hex[:12]}")
        sender = cls(client, store, workers, agent, buckets, stall_timeout_s)
        mem = "VRAM" if device.type == "cuda" else "DRAM"
        published = wire.TrainerBuffers(
            agent.name,
            mem,
            tuple((b.data_ptr(), b.numel(), max(b.get_device(), 0)) for b in buckets.buffers),
        )
        store.set(wire.METADATA_KEY, agent.get_agent_metadata())
        store.set(wire.TRAINER_KEY, published.to_bytes())
        init_info = {
            "master_address": host,
            "master_port": store.port,
            "world_size": workers + 1,
            "timeout_s": timeout_s,
            "stall_timeout_s": stall_timeout_s,
        }
        try:
            join(client, init_info, timeout_s)
        except BaseException:
            sender.close()
            raise
        return sender

    def _stream(self, plan: TransferPlan, produce: Produce, answer: Future | None = None) -> None:
        check = PlanCheck(plan)
        digest = wire.PartsDigest(plan.names, plan.dtypes, plan.shapes)
        numbers = self._numbers[plan.round] = itertools.count()

        def send(i: int, bucket: torch.Tensor, entries: list[BucketEntry]) -> _Pulled:
            n = next(numbers)
            record = wire.Bucket(
                i,
                bucket.numel(),
                tuple(wire.Entry(check.index[e.name], e.start, e.offset, e.size) for e in entries),
            )
            self.store.set(wire.bucket_key(plan.round, n), wire.encode(record))
            # the workers read the buffer meanwhile; the digest reads host bytes we own
            host = bucket if self._host is None else self._host[: bucket.numel()]
            if self._host is not None:
                host.copy_(bucket)
            for e in entries:
                part = host[e.offset : e.offset + e.size].numpy()
                digest.feed(check.index[e.name], part, e.start + e.size == e.total)
            return _Pulled(self, plan.round, n, answer)

        def checked(pack: Callable[[str, torch.Tensor], None]):
            def sink(name: str, tensor: torch.Tensor) -> None:
                check(name, tensor)
                pack(name, tensor)

            return produce(sink)

        self.buckets.stream(checked, send)
        end = wire.End(digest.hexdigest())
        self.store.set(wire.bucket_key(plan.round, next(numbers)), wire.encode(end))
        del self._numbers[plan.round]

    def _abort(self, plan: TransferPlan, reason: str) -> bool:
        numbers = self._numbers.pop(plan.round, None)
        if numbers is None or self.store is None:
            return False
        self.store.set(wire.bucket_key(plan.round, next(numbers)), wire.encode(wire.Abort(reason)))
        return True

    def quit_reasons(self, round_id: str) -> str:
        """What the workers that stopped reading `round_id` said, by rank."""
        reasons = []
        for rank in range(1, self.workers + 1):
            key = wire.quit_reason_key(round_id, rank)
            if self.store.check([key]):
                reasons.append(f"worker {rank}: {self.store.get(key).decode(errors='replace')}")
        return "; ".join(reasons) or "no reason given"

    def close(self) -> None:
        """Release the buffers' registration; the sender cannot send afterwards."""
        if self._registered is not None:
            self.agent.deregister_memory(self._registered)
            self._registered = None
        super().close()
