"""When the API server gives up on a full-weight stage: after a stall, not at a fixed time.

Why: a full-weight update's stage lasts as long as its bytes take to arrive (a 70B model over
gloo: minutes; the fixed 300 s of a LoRA stage cut such an update off while it was still
moving bytes), and a trainer that stopped sending must not hold the server for as long as the
largest model would take. So a full-weight stage is ended only once *no worker of some engine
still staging received anything* for the stall window (`--art-weights-stall-timeout`,
default `DEFAULT_STALL_S`), read from the workers' progress records
(`art_vllm_plugin.stage_progress`), and the message names that engine, each waiting worker's
rank, the bytes and tensors it received out of the update's total, and how long nothing
moved. A worker with no record yet counts as idle since the wait began (it has not started
receiving: an engine that never picks the stage up stalls too).

No overall cap: an update that keeps moving bytes runs to its end, whatever its size. The
engines' own limit on an update's life (`slot_registry.RESERVATION_TTL_S`, after which engine
0 would admit another update and an engine would free what was staged) is pushed back while
the stage progresses (`slot_publish.wait_staged` renews the update, `art_renew_update`).
LoRA stages keep their fixed deadline (`slot_publish.STAGE_TIMEOUT_S`): their workers report
no progress, and an adapter is read from a local file in well under it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from art_vllm_plugin.stage_progress import Progress

#: `--art-weights-stall-timeout` when not given.
DEFAULT_STALL_S = 120.0
FLAG = "--art-weights-stall-timeout"


@dataclass(frozen=True)
class StallRule:
    """The stall window, and the update's size the message measures progress against."""

    stall_s: float = DEFAULT_STALL_S
    total_bytes: int | None = None
    total_tensors: int | None = None

    def __post_init__(self) -> None:
        if not self.stall_s > 0:
            raise ValueError(f"{FLAG}: expected a positive number of seconds, got {self.stall_s}")


@dataclass(frozen=True)
class EngineSeen:
    """What one engine still staging showed in one look: its workers that have not left a
    marker (`waiting`; None while unknown: its stage call has not answered) and their
    progress records, by rank."""

    dp_rank: int
    waiting: list[int] | None
    progress: dict[int, Progress]


class StallWatch:
    """Judges looks at the engines still staging (`stalled`). `clock` is monotonic seconds."""

    def __init__(self, rule: StallRule, clock=time.monotonic):
        self.rule = rule
        self.clock = clock
        self.started = clock()

    def idle_s(self, seen: EngineSeen) -> float:
        """How long no worker of this engine that is still staging received anything."""
        since_start = self.clock() - self.started
        if seen.waiting is not None and not seen.waiting:
            return 0.0  # every worker left its marker: nothing to wait for
        ranks = seen.waiting if seen.waiting is not None else sorted(seen.progress)
        idle = [
            min(seen.progress[r].idle_s, since_start) if r in seen.progress else since_start
            for r in ranks
        ]
        return min(idle, default=since_start)

    def stalled(self, engines: list[EngineSeen]) -> str | None:
        """None while every engine moved bytes within the window; else what stalled, for the
        error: each stalled engine with its waiting workers' ranks, bytes and tensors of the
        total and the idle seconds, then the other engines still staging, likewise (they are
        ended with it)."""
        idle = [(seen, self.idle_s(seen)) for seen in engines]
        stalled = [(seen, s) for seen, s in idle if s >= self.rule.stall_s]
        if not stalled:
            return None
        others = [(seen, s) for seen, s in idle if s < self.rule.stall_s]
        text = "; ".join(self._engine(seen, s) for seen, s in stalled)
        text += f", past the stall window of {self.rule.stall_s:g} s ({FLAG})"
        if others:
            text += "; still staging then: " + "; ".join(self._engine(e, s) for e, s in others)
        return text

    def _engine(self, seen: EngineSeen, idle: float) -> str:
        ranks = seen.waiting if seen.waiting is not None else sorted(seen.progress)
        workers = ", ".join(self._worker(r, seen.progress.get(r)) for r in ranks)
        return (
            f"engine {seen.dp_rank} received nothing for {idle:.1f} s "
            f"({workers or 'no worker started staging'})"
        )

    def _worker(self, rank: int, progress: Progress | None) -> str:
        of_bytes = f" of {self.rule.total_bytes}" if self.rule.total_bytes is not None else ""
        of_tensors = f" of {self.rule.total_tensors}" if self.rule.total_tensors is not None else ""
        got, tensors = (0, 0) if progress is None else (progress.bytes, progress.tensors)
        return f"worker rank {rank}: {got}{of_bytes} bytes and {tensors}{of_tensors} tensors"


def engine_progress(rule: StallRule, engine: int, records: dict[int, Progress]) -> dict:
    """One engine's entry of `GET /art/v1/weights`'s `progress` while an update stages: what
    its slowest worker received (`bytes`, `tensors`: every worker receives every tensor of a
    stream, so the slowest one says how far the engine got) of the total, the seconds since
    any of its workers received anything (`idle_s`; None before any worker started), and
    each worker's record."""
    workers = [records[r] for r in sorted(records)]
    return {
        "engine": engine,
        "bytes": min((w.bytes for w in workers), default=0),
        "total_bytes": rule.total_bytes,
        "tensors": min((w.tensors for w in workers), default=0),
        "total_tensors": rule.total_tensors,
        "idle_s": min((round(w.idle_s, 3) for w in workers), default=None),
        "workers": [w.to_json() for w in workers],
    }
