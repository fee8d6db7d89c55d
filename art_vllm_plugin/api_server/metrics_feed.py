"""The in-memory metrics snapshot behind `GET /art/metrics`, fed by the stat-logger plugin.

vLLM calls the stat logger's `record()` once per engine step on the API server's event loop,
the same thread that serves `/art/metrics`, so the feed needs no lock: `record()` does a few
attribute writes and one deque append (O(1)), and the route reads them. The Prometheus text
route renders every metric on every scrape; this route only formats one small JSON object.

Schema 2 (for the autotuner) adds the scheduler's limits (`max_num_seqs`,
`max_num_batched_tokens`, set once from the engine config), `num_waiting_for_capacity`
(requests the last step left waiting while the scheduler was at its sequence limit or its KV
cache was at least `KV_FULL_FRACTION` used: adding load there only queues),
`num_waiting_deferred` (waiting on something other than capacity, e.g. a remote KV transfer),
`preemptions_total` and `idle` (the last step left nothing running or waiting: an idle engine
reports no steps, so its snapshot ages without being stale).

Schema 3 adds each slot's `digest` (`art_protocol.digest` of the adapter it serves;
version 0: the start adapter) and takes the slot fields (version, digest, updates,
failed_updates, last_update_ms) from EngineCore's slot registry, so every API server of a
deployment reports the same ones; `failed_updates_total` still adds this API server's own
refusals of requests that named no known slot. The engine fields (steps, queues, tokens) are
this API server's view (vLLM's stat logger of this process).

The Prometheus gauge `art:slot_version{slot}` (on vLLM's `/metrics`) is made here too.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

SCHEMA_VERSION = 3
TOKENS_WINDOW_S = 10.0
KV_FULL_FRACTION = 0.95


@dataclass
class MetricsFeed:
    started_at: float = field(default_factory=time.time)
    last_record_time: float | None = None
    engine_steps: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_waiting_deferred: int = 0
    num_waiting_for_capacity: int = 0
    preemptions: int = 0
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    generation_tokens: int = 0
    # (time, generation tokens in that step), trimmed to the window when read
    window: deque = field(default_factory=lambda: deque(maxlen=65536))

    def set_limits(self, max_num_seqs: int | None, max_num_batched_tokens: int | None) -> None:
        """The scheduler's limits, from the engine config (once, at stat-logger creation)."""
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens

    def record(self, scheduler_stats, iteration_stats) -> None:
        now = time.time()
        self.last_record_time = now
        if scheduler_stats is not None:
            self.engine_steps += 1
            self.num_running = scheduler_stats.num_running_reqs
            self.num_waiting = scheduler_stats.num_waiting_reqs
            self.num_waiting_deferred = scheduler_stats.num_skipped_waiting_reqs
            self.kv_cache_usage = scheduler_stats.kv_cache_usage
            full = self.kv_cache_usage >= KV_FULL_FRACTION or (
                self.max_num_seqs is not None and self.num_running >= self.max_num_seqs
            )
            self.num_waiting_for_capacity = self.num_waiting if full else 0
            prefix = scheduler_stats.prefix_cache_stats
            if prefix is not None:
                self.prefix_queries += prefix.queries
                self.prefix_hits += prefix.hits
        if iteration_stats is not None:
            self.preemptions += iteration_stats.num_preempted_reqs
        if iteration_stats is not None and iteration_stats.num_generation_tokens:
            self.generation_tokens += iteration_stats.num_generation_tokens
            self.window.append((now, iteration_stats.num_generation_tokens))

    def tokens_per_s(self, now: float) -> float:
        cutoff = now - TOKENS_WINDOW_S
        while self.window and self.window[0][0] < cutoff:
            self.window.popleft()
        return sum(n for _, n in self.window) / TOKENS_WINDOW_S

    def snapshot(self, slots, failed_unattributed: int) -> dict:
        now = time.time()
        slots = list(slots)
        snap_time = self.last_record_time or self.started_at
        return {
            "schema_version": SCHEMA_VERSION,
            "snapshot_time": snap_time,
            "age_s": max(0.0, now - snap_time),
            "engine_step": self.engine_steps,
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "num_waiting_for_capacity": self.num_waiting_for_capacity,
            "num_waiting_deferred": self.num_waiting_deferred,
            "idle": self.num_running == 0 and self.num_waiting == 0,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "preemptions_total": self.preemptions,
            "kv_cache_usage": self.kv_cache_usage,
            "prefix_cache_hit_rate": (
                self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
            ),
            "generation_tokens_total": self.generation_tokens,
            "generation_tokens_per_s": self.tokens_per_s(now),
            "generation_tokens_window_s": TOKENS_WINDOW_S,
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


#: The process's feed: written by `ArtStatLogger.record`, read by the `/art/metrics` route.
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
