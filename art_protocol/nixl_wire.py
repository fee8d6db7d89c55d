"""The control records of the `art_nixl` stream: what the trainer tells the workers through its
store, and the digest both ends compute over a stream that arrives in buckets.

The bytes move by NIXL (each worker READs a bucket from the trainer's registered buffers); the
store only says where they are. The rules are in `art_protocol.weight_transfer` (section
`art_nixl`); this module is their typed form, one definition for trainer and worker.
Importable without torch, vLLM or NIXL (xxhash only where a digest is computed).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

#: Where the trainer publishes its agent (JSON, `TrainerBuffers`) and its NIXL agent metadata
#: (raw bytes), once per `connect`, before the workers are asked to join.
TRAINER_KEY = "art-weights/nixl/trainer"
METADATA_KEY = "art-weights/nixl/metadata"


def bucket_key(round_id: str, n: int) -> str:
    """The record of bucket `n` (0, 1, ...) of stream `round_id`: a `Bucket`, `End` or `Abort`."""
    return f"art-weights/{round_id}/bucket/{n}"


def pulled_key(round_id: str, n: int) -> str:
    """A counter every worker adds 1 to once it has READ bucket `n` into its own buffer."""
    return f"art-weights/{round_id}/pulled/{n}"


def all_pulled_key(round_id: str, n: int) -> str:
    """Set by the worker whose add made `pulled_key` reach the number of workers: the trainer's
    buffer of bucket `n` may be written again."""
    return f"art-weights/{round_id}/pulled/{n}/all"


def quit_key(round_id: str) -> str:
    """A counter a worker adds 1 to when it stops reading the stream before its end (its reason
    under `quit_reason_key`): the trainer stops sending instead of waiting for its pulls."""
    return f"art-weights/{round_id}/quit"


def quit_reason_key(round_id: str, rank: int) -> str:
    return f"art-weights/{round_id}/quit/{rank}"


class WireError(ValueError):
    """A record that breaks the wire's rules (the sender's fault: nothing of the stream is used)."""


@dataclass(frozen=True)
class TrainerBuffers:
    """The trainer's NIXL agent and its registered buffers (`buffers[i]` = (address, bytes,
    device id)); `mem` is NIXL's memory type, `DRAM` or `VRAM`."""

    agent: str
    mem: str
    buffers: tuple[tuple[int, int, int], ...]

    def to_bytes(self) -> bytes:
        return json.dumps(
            {"agent": self.agent, "mem": self.mem, "buffers": [list(b) for b in self.buffers]}
        ).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> TrainerBuffers:
        body = json.loads(raw)
        return cls(
            body["agent"], body["mem"], tuple(tuple(int(x) for x in b) for b in body["buffers"])
        )

    @property
    def bucket_bytes(self) -> int:
        return min(size for _, size, _ in self.buffers)


@dataclass(frozen=True)
class Entry:
    """`size` bytes at `offset` in the bucket are bytes `start .. start + size` of plan tensor
    `index`."""

    index: int
    start: int
    offset: int
    size: int


@dataclass(frozen=True)
class Bucket:
    """Bucket `n` is the first `used` bytes of the trainer's buffer `buffer`."""

    buffer: int
    used: int
    entries: tuple[Entry, ...]


@dataclass(frozen=True)
class End:
    """The stream is complete; `digest` is `art_protocol.weights_digest`'s of every tensor sent."""

    digest: str


@dataclass(frozen=True)
class Abort:
    """The trainer stopped the stream; nothing of it may be used."""

    reason: str


Record = Bucket | End | Abort


def encode(record: Record) -> bytes:
    if isinstance(record, Bucket):
        entries = [[e.index, e.start, e.offset, e.size] for e in record.entries]
        body = {"buffer": record.buffer, "used": record.used, "entries": entries}
    elif isinstance(record, End):
        body = {"end": record.digest}
    else:
        body = {"abort": record.reason}
    return json.dumps(body, separators=(",", ":")).encode()


def decode(raw: bytes) -> Record:
    """The record in `raw`, or `WireError` naming what is malformed."""
    try:
        body = json.loads(raw)
        if "end" in body:
            return End(str(body["end"]))
        if "abort" in body:
            return Abort(str(body["abort"]))
        entries = tuple(Entry(*(int(x) for x in e)) for e in body["entries"])
        return Bucket(int(body["buffer"]), int(body["used"]), entries)
    except (ValueError, KeyError, TypeError) as exc:
        raise WireError(f"malformed stream record {raw[:200]!r}: {exc}") from exc


class PartsDigest:
    """The stream digest (`art_protocol.weights_digest`) fed with each tensor's bytes in the
    parts its buckets carry, a part at a time per tensor and in order, so neither end ever
    holds a tensor's bytes whole in host memory to hash it. Both ends use it, each on host bytes
    it owns (a CPU bucket, or a pinned host copy of a GPU one)."""

    def __init__(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
    ):
        from art_protocol.weights_digest import WeightsDigest

        self.names, self.dtypes, self.shapes = names, dtypes, shapes
        self.digest = WeightsDigest()
        self._open: dict[int, list] = {}

    def feed(self, index: int, data, done: bool) -> None:
        """Bytes `data` (any buffer) continue tensor `index`; `done`: they are its last."""
        import xxhash

        part = self._open.get(index)
        if part is None:
            part = self._open[index] = [xxhash.xxh3_128(), 0]
        view = memoryview(data).cast("B")
        part[0].update(view)
        part[1] += view.nbytes
        if done:
            del self._open[index]
            name, dtype, shape = self.names[index], self.dtypes[index], self.shapes[index]
            self.digest.add(name, dtype, shape, part[0].digest(), part[1])

    def hexdigest(self) -> str:
        return self.digest.hexdigest()
