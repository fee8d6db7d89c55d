"""A worker's end of an `art_nixl` stream: READ each bucket out of the trainer's registered
buffers into one buffer of its own, and hand every tensor it completes to a sink.

Why a class of its own, apart from the vLLM engine (`nixl_transfer.py`): the wire runs without
vLLM (torch, NIXL and the trainer's store only), so it is tested between plain processes
(tests/art_vllm_plugin/worker/test_nixl_wire.py), and the engine is a thin shell around it.

Memory: one receive buffer of the trainer's bucket size, registered once (on the worker's
device where it is a GPU, host memory on CPU), the tensors being reassembled (a tensor larger
than a bucket arrives in parts), and on a GPU one pinned host buffer of a bucket for the
digest. What the sink keeps is its business (the staging sink keeps this worker's shard).

Deadlines come from progress, not from the size of the update: a worker waits up to
`stall_timeout_s` for each next bucket, so a stream that keeps moving is never cut off, and
one whose trainer stalled ends naming the round and the bytes received.
Rules: `art_protocol.weight_transfer` (section `art_nixl`), records `art_protocol.nixl_wire`.
"""

from __future__ import annotations

import datetime
import math
import time
import uuid

import torch

from art_protocol import nixl_wire as wire
from art_protocol.nixl_api import new_agent
from art_protocol.weight_transfer import ready_key
from art_vllm_plugin.tensor_checks import all_finite
from art_vllm_plugin.worker.stream_errors import StreamRefused


class StreamStalled(TimeoutError):
    """No progress for longer than the stall deadline: the transport, not the stream's
    content, failed (the update is refused as an engine failure)."""


def _itemsize(dtype_name: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype_name)).element_size()


class _Open:
    """A tensor whose bytes are still arriving."""

    def __init__(self, total: int, device):
        self.flat = torch.empty(total, dtype=torch.uint8, device=device)
        self.filled = 0


class NixlReceiver:
    """One worker's agent, receive buffer and view of the trainer's buffers."""

    def __init__(self, store, rank: int, workers: int, device, stall_timeout_s: float):
        self.store, self.rank, self.workers = store, rank, workers
        self._waiter = None  # a client of the store that only waits (see `_next_record`)
        self.device = torch.device(device)
        self.stall_timeout_s = stall_timeout_s
        # published by the trainer before it asked the workers to join
        self.trainer = wire.TrainerBuffers.from_bytes(store.get(wire.TRAINER_KEY))
        self.agent = new_agent(f"art-worker-{rank}-{uuid.uuid4().hex[:12]}")
        self.remote = self.agent.add_remote_agent(store.get(wire.METADATA_KEY))
        size = self.trainer.bucket_bytes
        self.buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._registered = self.agent.register_memory(self.buffer)
        cuda = self.device.type == "cuda"
        self.mem = "VRAM" if cuda else "DRAM"
        self._dev_id = max(self.buffer.get_device(), 0)
        self.host = torch.empty(size, dtype=torch.uint8, pin_memory=True) if cuda else self.buffer

    def receive(self, info, sink) -> str:
        """Receive stream `info` (`names`, `dtype_names`, `shapes`, `round`, `digest`: the plan
        and the request's digest, or None), handing each tensor to `sink(name, tensor)`.
        Returns the digest of what arrived. Raises `StreamRefused` when the trainer aborted,
        the stream broke the wire or its plan, a value is NaN or infinite, or a digest
        differs (the last three after the whole stream was read); `StreamStalled` when no
        bucket came for `stall_timeout_s`. A worker that stops before the end says why in the
        store, so the trainer stops too."""
        self.store.set(ready_key(info.round, self.rank), b"1")
        try:
            return self._receive(info, sink)
        except _Ended as ended:
            raise ended.error from None
        except BaseException as exc:
            reason = f"{type(exc).__name__}: {exc}"
            self.store.set(wire.quit_reason_key(info.round, self.rank), reason.encode())
            self.store.add(wire.quit_key(info.round), 1)
            raise

    def _receive(self, info, sink) -> str:
        names, dtypes, shapes = info.names, info.dtype_names, info.shapes
        totals = [math.prod(s) * _itemsize(d) for s, d in zip(shapes, dtypes, strict=True)]
        digest = wire.PartsDigest(names, dtypes, shapes)
        open_: dict[int, _Open] = {}
        seen: set[int] = set()
        problems: list[str] = []
        received = 0
        n = 0
        while True:
            record = self._next_record(info.round, n, received)
            if isinstance(record, wire.Abort):
                raise StreamRefused(
                    f"the trainer ended round {info.round} after {received} bytes: {record.reason}"
                )
            if isinstance(record, wire.End):
                break
            self._check_bucket(record, n, info.round)
            self._read(record, n, info.round, received)
            self._count_pulled(info.round, n)
            host = self.host[: record.used]
            if host.data_ptr() != self.buffer.data_ptr():
                host.copy_(self.buffer[: record.used])
            received += record.used
            for e in record.entries:
                if not 0 <= e.index < len(names) or e.index in seen:
                    raise StreamRefused(
                        f"bucket {n}: tensor index {e.index} is outside the plan or sent twice"
                    )
                if e.start == 0:
                    if e.index in open_:
                        raise StreamRefused(f"bucket {n}: {names[e.index]} started twice")
                    open_[e.index] = _Open(totals[e.index], self.device)
                part = open_.get(e.index)
                if (
                    part is None
                    or part.filled != e.start
                    or e.start + e.size > totals[e.index]
                    or e.offset + e.size > record.used
                ):
                    raise StreamRefused(
                        f"bucket {n}: bytes {e.start}..{e.start + e.size} of {names[e.index]} "
                        "arrive out of order or outside the tensor or the bucket"
                    )
                span = slice(e.offset, e.offset + e.size)
                part.flat[e.start : e.start + e.size].copy_(self.buffer[span])
                part.filled += e.size
                done = part.filled == totals[e.index]
                digest.feed(e.index, host[span].numpy(), done)
                if done:
                    del open_[e.index]
                    seen.add(e.index)
                    dtype = getattr(torch, dtypes[e.index])
                    tensor = part.flat.view(dtype).reshape(shapes[e.index])
                    if not all_finite(tensor):
                        problems.append(f"{names[e.index]}: holds NaN or infinite values")
                    sink(names[e.index], tensor)
            if self.device.type == "cuda":  # our buffer is read out before NIXL writes it again
                torch.cuda.current_stream(self.device).synchronize()
            n += 1
        problems += [f"{names[i]}: cut short" for i in sorted(open_)]
        missing = [i for i in range(len(names)) if i not in seen and i not in open_]
        problems += [f"{names[i]}: not sent" for i in missing]
        got = digest.hexdigest()
        if record.digest != got:
            problems.append(f"the digest of what arrived ({got}) is not the one sent with it")
        if info.digest is not None and info.digest != got:
            problems.append(
                f"the digest of what arrived ({got}) is not the request's {info.digest}"
            )
        if problems:
            raise _Ended(StreamRefused("; ".join(problems)))
        return got

    def _next_record(self, round_id: str, n: int, received: int):
        """Wait up to the stall deadline for record `n`. The wait runs on a store client of
        its own, dropped when it times out: a TCPStore client whose wait timed out still gets
        the server's answer to that wait later, which the next command on that connection
        would read as its own (found running it: the stalled worker's next `set` hung)."""
        key = wire.bucket_key(round_id, n)
        if self._waiter is None:
            self._waiter = torch.distributed.TCPStore(
                self.store.host, self.store.port, is_master=False, timeout=self.store.timeout
            )
        try:
            self._waiter.wait([key], datetime.timedelta(seconds=self.stall_timeout_s))
        except torch.distributed.DistStoreError as exc:
            self._waiter = None
            raise StreamStalled(
                f"round {round_id}: no bucket from the trainer for {self.stall_timeout_s} s "
                f"after {n} buckets, {received} bytes received"
            ) from exc
        return wire.decode(self.store.get(key))

    def _check_bucket(self, record: wire.Bucket, n: int, round_id: str) -> None:
        buffers = self.trainer.buffers
        if not 0 <= record.buffer < len(buffers) or not 0 < record.used <= len(self.buffer):
            raise StreamRefused(
                f"round {round_id} bucket {n}: buffer {record.buffer} with {record.used} bytes "
                f"is not one of the trainer's {len(buffers)} buffers of {len(self.buffer)} bytes"
            )

    def _read(self, record: wire.Bucket, n: int, round_id: str, received: int) -> None:
        """READ the bucket's bytes out of the trainer's buffer into ours."""
        address, _, dev_id = self.trainer.buffers[record.buffer]
        local = self.agent.get_xfer_descs(
            [(self.buffer.data_ptr(), record.used, self._dev_id)], self.mem
        )
        remote = self.agent.get_xfer_descs([(address, record.used, dev_id)], self.trainer.mem)
        handle = self.agent.initialize_xfer("READ", local, remote, self.remote)
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + self.stall_timeout_s
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise StreamStalled(
                        f"round {round_id}: reading bucket {n} took over {self.stall_timeout_s} "
                        f"s, {received} bytes received before it"
                    )
                time.sleep(0)
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(
                    f"round {round_id}: NIXL could not read bucket {n} from the trainer "
                    f"({state}), {received} bytes received before it"
                )
        finally:
            self.agent.release_xfer_handle(handle)

    def _count_pulled(self, round_id: str, n: int) -> None:
        """Count this worker done with bucket `n`; the last one tells the trainer."""
        if self.store.add(wire.pulled_key(round_id, n), 1) == self.workers:
            self.store.set(wire.all_pulled_key(round_id, n), b"1")

    def close(self) -> None:
        if self._registered is not None:
            self.agent.deregister_memory(self._registered)
            self.agent.remove_remote_agent(self.remote)
            self._registered = None
        self._waiter = None


class _Ended(Exception):
    """The stream was read to its end and is refused: no reason to tell the trainer to stop."""

    def __init__(self, error: StreamRefused):
        super().__init__(str(error))
        self.error = error
