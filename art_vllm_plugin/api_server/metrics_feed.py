"""The in-memory metrics snapshot behind `GET /art/metrics`: one entry per engine, and their sum.

Where an engine's figures come from (`art_vllm_plugin/engine_figures.py`):
- one API server: vLLM calls the stat logger's `record()` once per engine step, for every
  engine, on the API server's event loop (the thread that serves `/art/metrics`), so the feed
  needs no lock; `record()` adds the step to that engine's entry (O(1));
- several API servers: vLLM gives each step's stats to one of them only, so the engines push
  their own figures to every API server that subscribed (`engine_core/figures_push.py`);
  `apply_row` replaces the engine's entry with what it sent, and from then on the stat
  logger's records for that engine are ignored (they are a part of its steps only).

An idle engine takes no steps and sends nothing: its entry is what its last step left (0
running once it drained), and ages without being stale (`idle`).

The snapshot (schema 4) has `engines: [...]`, one entry per engine (DP rank order), each with
the engine fields below for that engine, and the same fields at the top level for the
deployment: counts and limits summed over the engines (`num_running`, `max_num_seqs`, ...,
`generation_tokens_per_s`), `kv_cache_usage` their mean, `prefix_cache_hit_rate` hits over
queries of all, `idle` when every engine is, `snapshot_time` the newest engine report.

Schema history: 2 added the scheduler's limits, `num_waiting_for_capacity` (requests the last
step left waiting while the scheduler was at its sequence limit or its KV cache was at least
`engine_figures.KV_FULL_FRACTION` used: adding load there only queues),
`num_waiting_deferred` (waiting on something other than capacity, e.g. a remote KV transfer),
`preemptions_total` and `idle`.
3 added each slot's `digest` and took the slot fields (version, digest, updates,
failed_updates, last_update_ms) from EngineCore's slot registry, so every API server reports
the same ones; `failed_updates_total` still adds this API server's own refusals of requests
that named no known slot. 4 added `engines` and made the top-level engine fields the
deployment's (before, with several engines, they were whichever engine reported last).

The Prometheus gauge `art:slot_version{slot}` (on vLLM's `/metrics`) is made here too.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from art_vllm_plugin.compat import figures as vllm_figures
from art_vllm_plugin.engine_figures import EngineFigures

SCHEMA_VERSION = 4
TOKENS_WINDOW_S = 10.0


@dataclass
class EngineFeed:
    """One engine's figures as this API server knows them, and its recent token counts."""

    figures: EngineFigures
    #: The engine pushes its figures here (several API servers): records are ignored.
    pushed: bool = False
    #: (time received, generation tokens since the previous report), trimmed when read
    window: deque = field(default_factory=lambda: deque(maxlen=65536))

    def record(self, now: float, scheduler_stats, iteration_stats) -> None:
        if self.pushed:
            return
        f = self.figures
        if scheduler_stats is not None:
            f.add_step(now, *vllm_figures.scheduler_stats_values(scheduler_stats))
        if iteration_stats is not None:
            tokens, preempted = vllm_figures.iteration_stats_values(iteration_stats)
            f.preemptions += preempted
            if tokens:
                f.generation_tokens += tokens
                self.window.append((now, tokens))

    def apply(self, now: float, figures: EngineFigures) -> None:
        """The engine's own figures (a push): they replace what was recorded (the first one
        also the recorded tokens: a part of the engine's steps only)."""
        if not self.pushed:
            self.window.clear()
        elif (tokens := figures.generation_tokens - self.figures.generation_tokens) > 0:
            self.window.append((now, tokens))
        self.figures, self.pushed = figures, True

    def tokens_per_s(self, now: float) -> float:
        cutoff = now - TOKENS_WINDOW_S
        while self.window and self.window[0][0] < cutoff:
            self.window.popleft()
        return sum(n for _, n in self.window) / TOKENS_WINDOW_S


def _engine_fields(f: EngineFigures, snap_time: float, now: float, limits, per_s: float) -> dict:
    max_num_seqs, max_num_batched_tokens = limits
    return {
        "snapshot_time": snap_time,
        "age_s": max(0.0, now - snap_time),
        "engine_step": f.steps,
        "num_running": f.num_running,
        "num_waiting": f.num_waiting,
        "num_waiting_for_capacity": f.waiting_for_capacity(max_num_seqs),
        "num_waiting_deferred": f.num_waiting_deferred,
        "idle": f.idle,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "preemptions_total": f.preemptions,
        "kv_cache_usage": f.kv_cache_usage,
        "prefix_cache_hit_rate": f.prefix_hits / f.prefix_queries if f.prefix_queries else 0.0,
        "generation_tokens_total": f.generation_tokens,
        "generation_tokens_per_s": per_s,
    }


def _times(limit: int | None, engines: int) -> int | None:
    return limit * engines if limit is not None else None


@dataclass
class MetricsFeed:
    started_at: float = field(default_factory=time.time)
    #: DP rank -> its feed (every engine this API server manages, from the stat logger's
    #: creation; an engine that pushes before that is added then)
    engines: dict[int, EngineFeed] = field(default_factory=dict)
    #: One engine's scheduler limits (engine config; the same for every engine).
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None

    def engine(self, index: int) -> EngineFeed:
        feed = self.engines.get(index)
        if feed is None:
            feed = self.engines[index] = EngineFeed(EngineFigures(index))
        return feed

    def set_limits(self, max_num_seqs: int | None, max_num_batched_tokens: int | None) -> None:
        """The scheduler's limits, from the engine config (once, at stat-logger creation)."""
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens

    def record(self, engine: int, scheduler_stats, iteration_stats) -> None:
        """One step of `engine`, as vLLM's stat logger hands it to this API server."""
        self.engine(engine).record(time.time(), scheduler_stats, iteration_stats)

    def apply_row(self, row) -> None:
        """An engine's own figures (`EngineFigures.row`), pushed or returned at subscription."""
        figures = EngineFigures.from_row(row)
        self.engine(figures.engine).apply(time.time(), figures)

    def registry_generation(self, engine: int) -> int | None:
        """The slot-registry generation `engine` last pushed (None: it does not push)."""
        feed = self.engines.get(engine)
        return feed.figures.registry_generation if feed is not None and feed.pushed else None

    @property
    def engine_steps(self) -> int:
        return sum(e.figures.steps for e in self.engines.values())

    @property
    def last_record_time(self) -> float | None:
        times = [e.figures.step_time for e in self.engines.values() if e.figures.step_time]
        return max(times) if times else None

    def snapshot(self, slots, failed_unattributed: int) -> dict:
        now = time.time()
        slots = list(slots)
        limits = (self.max_num_seqs, self.max_num_batched_tokens)
        engines = []
        for index in sorted(self.engines):
            feed = self.engines[index]
            snap_time = feed.figures.step_time or self.started_at
            entry = _engine_fields(feed.figures, snap_time, now, limits, feed.tokens_per_s(now))
            engines.append({"engine": index, **entry})
        snap_time = self.last_record_time or self.started_at
        total = {
            "snapshot_time": snap_time,
            "age_s": max(0.0, now - snap_time),
            "idle": all(e["idle"] for e in engines),
            "kv_cache_usage": (
                sum(e["kv_cache_usage"] for e in engines) / len(engines) if engines else 0.0
            ),
        }
        for name in (
            "engine_step",
            "num_running",
            "num_waiting",
            "num_waiting_for_capacity",
            "num_waiting_deferred",
            "preemptions_total",
            "generation_tokens_total",
            "generation_tokens_per_s",
        ):
            total[name] = sum(e[name] for e in engines)
        queries = sum(e.figures.prefix_queries for e in self.engines.values())
        hits = sum(e.figures.prefix_hits for e in self.engines.values())
        n = max(1, len(engines))  # (before any engine is known: one engine's limits)
        return {
            "schema_version": SCHEMA_VERSION,
            **total,
            "max_num_seqs": _times(self.max_num_seqs, n),
            "max_num_batched_tokens": _times(self.max_num_batched_tokens, n),
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "generation_tokens_window_s": TOKENS_WINDOW_S,
            "engines": engines,
            "slots": {
                s.name: {
                    "version": s.version,
                    "digest": s.digest,
                    "updates": s.updates,
                    "failed_updates": s.failed_updates,
                    "last_update_ms": s.last_update_ms,
                }
                for s in slots
            },
            "updates_total": sum(s.updates for s in slots),
            "failed_updates_total": sum(s.failed_updates for s in slots) + failed_unattributed,
        }


#: The process's feed: written by `ArtStatLogger.record` and the engines' pushes, read by the
#: `/art/metrics` route.
FEED = MetricsFeed()


#: The Prometheus gauge, created once per process: prometheus_client's registry is
#: process-wide and refuses a second metric of the same name.
_SLOT_VERSION_GAUGE: list = []


def slot_version_gauge():
    """Prometheus gauge `art:slot_version{slot}` on vLLM's `/metrics` (created once)."""
    if not _SLOT_VERSION_GAUGE:
        from prometheus_client import Gauge

        _SLOT_VERSION_GAUGE.append(
            Gauge(
                "art:slot_version",
                "Policy version served by each art LoRA slot",
                labelnames=["slot"],
            )
        )
    return _SLOT_VERSION_GAUGE[0]
