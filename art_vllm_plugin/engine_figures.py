"""One engine's figures for `/art/metrics`: the record both EngineCore and the API server keep.

Why one record for both sides: the API server learns an engine's figures two ways. With one
API server, vLLM hands it every step's stats (the stat logger adds them up here). With several
API servers (`--api-server-count N`, and `vllm serve --data-parallel-size N` starts N), vLLM
sends each step's stats to one API server only, so each engine adds its own steps up and sends
the record to every API server that asked (`engine_core/figures_push.py`); the API server
keeps what it was sent. Either way `/art/metrics` reads the same record per engine.

Counters run from the engine's start; gauges are those the engine's last step left, so an idle
engine reports what it drained to (0 running). `registry_generation` is the engine's slot
registry generation (`engine_core/slot_registry.py`): an API server whose cached registry was
read at that generation can answer from the cache.

Plain Python, no vLLM: it travels as a list (`row`), in one fixed order, with its format
number first.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields

#: Bumped when the row's fields change; a row of another format is refused, not misread.
FORMAT = 1
#: A step that leaves the KV cache at least this full counts its waiting requests as waiting
#: for capacity (adding load there only queues).
KV_FULL_FRACTION = 0.95


@dataclass
class EngineFigures:
    engine: int  # DP rank
    step_time: float | None = None  # wall-clock time of the last step with stats
    steps: int = 0  # steps with stats
    num_running: int = 0
    num_waiting: int = 0  # waiting and schedulable
    num_waiting_deferred: int = 0  # waiting on something else (e.g. a remote KV transfer)
    kv_cache_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    registry_generation: int = 0

    def add_step(
        self,
        now: float,
        running: int,
        waiting: int,
        deferred: int,
        kv_cache_usage: float,
        prefix_queries: int,
        prefix_hits: int,
    ) -> None:
        """One step's scheduler stats (counters are the step's own, added up here)."""
        self.step_time = now
        self.steps += 1
        self.num_running = running
        self.num_waiting = waiting
        self.num_waiting_deferred = deferred
        self.kv_cache_usage = kv_cache_usage
        self.prefix_queries += prefix_queries
        self.prefix_hits += prefix_hits

    @property
    def idle(self) -> bool:
        return self.num_running == 0 and self.num_waiting == 0 and self.num_waiting_deferred == 0

    def waiting_for_capacity(self, max_num_seqs: int | None) -> int:
        """Requests waiting while the engine was at its sequence limit or its KV cache full."""
        full = self.kv_cache_usage >= KV_FULL_FRACTION or (
            max_num_seqs is not None and self.num_running >= max_num_seqs
        )
        return self.num_waiting if full else 0

    def row(self) -> list:
        return [FORMAT, *astuple(self)]

    @classmethod
    def from_row(cls, row: list | tuple) -> EngineFigures:
        if not row or row[0] != FORMAT or len(row) != len(fields(cls)) + 1:
            raise ValueError(
                f"engine figures row of format {row[0] if row else None!r} with {len(row)} "
                f"fields; this plugin reads format {FORMAT} with {len(fields(cls)) + 1}"
            )
        return cls(*row[1:])
