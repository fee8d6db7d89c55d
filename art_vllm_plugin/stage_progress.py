"""How far a worker got staging a full-weight update: a record beside its markers.

Why: an update's deadline comes from progress, not from a fixed time (a 70B stream over gloo
takes minutes, a stalled trainer must not hold the server for as long): the API server ends
an update once no worker of an engine it waits for moved a byte for the stall window
(`api_server/stage_deadline.py`), and `GET /art/v1/weights` shows how far each engine got.
Both read what each worker leaves in its marker directory (`staging.marker_dir`) as
`progress.<rank>`: JSON `{"bytes": N, "tensors": K, "at": T}`, the checkpoint bytes and
tensors received so far and the wall-clock time of the last one. A worker writes it
atomically (write, then rename), at most every `WRITE_EVERY_S` (what arrived in between is
written by a timer then) and once more at the end, so a stream of many small tensors costs a
few file writes a second, not one per tensor.

The record is read where it was written (the API server for its local engines, an engine on
another host for its own, `engine_core/relayed_stages.art_stage_markers`), and what is passed
on is its age (`idle_s`), never a time stamp: two hosts' clocks need not agree.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from math import prod
from pathlib import Path

from art_protocol.checkpoint_layout import TensorSpec
from art_protocol.weights_digest import SAFETENSORS_DTYPES

PROGRESS = "progress"
#: Longest time between two writes of a worker's record while bytes arrive.
WRITE_EVERY_S = 0.25


@dataclass(frozen=True)
class Progress:
    """What worker `rank` had received, and for how long nothing arrived (`idle_s`)."""

    rank: int
    bytes: int
    tensors: int
    idle_s: float

    def to_json(self) -> dict:
        return {
            "rank": self.rank,
            "bytes": self.bytes,
            "tensors": self.tensors,
            "idle_s": self.idle_s,
        }

    @classmethod
    def from_json(cls, body: dict) -> Progress:
        return cls(
            int(body["rank"]), int(body["bytes"]), int(body["tensors"]), float(body["idle_s"])
        )


#: Bytes per element of every safetensors dtype a served checkpoint may hold
#: (`art_protocol.weights_digest.SAFETENSORS_DTYPES`).
ELEMENT_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


def element_bytes(code: str) -> int:
    """Bytes of one element of safetensors dtype `code`."""
    try:
        return ELEMENT_BYTES[code]
    except KeyError:
        raise ValueError(
            f"unknown safetensors dtype {code!r} (known: {sorted(ELEMENT_BYTES)})"
        ) from None


def layout_totals(layout: dict[str, TensorSpec]) -> tuple[int, int]:
    """(bytes, tensors) of an update with this layout, in its checkpoint form (what a worker
    counts as it receives or reads it)."""
    total = sum(element_bytes(s.dtype) * prod(s.shape) for s in layout.values())
    return total, len(layout)


def plan_totals(plan: dict) -> tuple[int, int]:
    """(bytes, tensors) of a stream's plan (`TransferPlan.to_json()`: torch dtype names)."""
    codes = {name: code for code, name in SAFETENSORS_DTYPES.items()}
    total = sum(
        element_bytes(codes.get(dtype, dtype)) * prod(shape)
        for dtype, shape in zip(plan["dtypes"], plan["shapes"], strict=True)
    )
    return total, len(plan["names"])


def records_of(answer: dict | None) -> dict[int, Progress]:
    """The records, by rank, of an engine's `art_stage_progress` answer (None: no stage)."""
    workers = [] if answer is None else answer["workers"]
    return {p.rank: p for p in map(Progress.from_json, workers)}


def path(marker_dir: str | Path, rank: int) -> Path:
    return Path(marker_dir) / f"{PROGRESS}.{rank}"


class Recorder:
    """A worker's progress record for one stage, written to `marker_dir` (throttled).

    A tensor that arrives within `WRITE_EVERY_S` of the last write is written by a timer that
    long after it, not never: the last tensors before a stall must reach the file, or the
    stall's message would understate what arrived. `clock` is the wall clock (`time.time`);
    a test that passes its own turns the timer off with `flush_later=False`."""

    def __init__(
        self, marker_dir: str | Path, rank: int, clock=time.time, flush_later: bool = True
    ):
        self.file = path(marker_dir, rank)
        self.rank = rank
        self.clock = clock
        self.flush_later = flush_later
        self.bytes = 0
        self.tensors = 0
        self.at = clock()
        self._written = float("-inf")
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self.write()  # the stage started: its idle time counts from now

    def add(self, nbytes: int, tensors: int = 1) -> None:
        """`tensors` more tensors of `nbytes` bytes in all arrived."""
        with self._lock:
            self.bytes += int(nbytes)
            self.tensors += tensors
            self.at = self.clock()
            wait = WRITE_EVERY_S - (self.at - self._written)
            if wait > 0:
                if self.flush_later and self._timer is None:
                    self._timer = threading.Timer(wait, self._flush)
                    self._timer.daemon = True
                    self._timer.start()
                return
        self.write()

    def _flush(self) -> None:
        with self._lock:
            self._timer = None
        self.write()

    def write(self) -> None:
        """Write the record now (also once at the end, so the last tensors are counted)."""
        with self._lock:
            record = {"bytes": self.bytes, "tensors": self.tensors, "at": self.at}
            tmp = self.file.with_name(f".{self.file.name}.tmp")
            try:
                tmp.write_text(json.dumps(record))
                tmp.rename(self.file)
            except OSError:
                return  # the update was abandoned and its directory removed; nobody reads it
            self._written = self.clock()


def read(
    marker_dir: str | Path, ranks: list[int] | None = None, now: float | None = None
) -> dict[int, Progress]:
    """The records of `ranks` (None: every record) found in `marker_dir`. A worker that wrote
    none is left out: it has not started, or stages something that reports no progress."""
    now = time.time() if now is None else now
    if ranks is None:
        try:
            names = [p.name for p in Path(marker_dir).glob(f"{PROGRESS}.*")]
        except OSError:
            names = []
        ranks = sorted(int(n.split(".")[1]) for n in names if n.split(".")[1].isdigit())
    out = {}
    for rank in ranks:
        try:
            record = json.loads(path(marker_dir, rank).read_text())
            out[rank] = Progress(
                rank, int(record["bytes"]), int(record["tensors"]), max(0.0, now - record["at"])
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue  # none yet (writes are renames: never a torn one)
    return out
