"""The simulated inference server: continuous batching as processor sharing, in service units.

Every running request advances at the same decode rate `rate(B) = single_tok_s * B**(alpha-1)`
tokens/s for B running requests, so the server's throughput `single_tok_s * B**alpha` grows
sublinearly with the batch. `S` counts the tokens each running request has received since the
start; a request admitted at `S0` with prefill work `p` and `n` decode tokens finishes at
`S0 + p + n`, and its decode token k is made at `S0 + p + k`. In-flight updates freeze `S` for
their latency (running requests keep their KV and continue with the new version, as the plugin
does), and version changes are marks on the `S` axis, so a finished request's policy spans
are the overlaps of its decode interval with the marks. Admission is limited by `max_num_seqs`
and by KV capacity (tokens: a request holds its prompt share plus one token per service
unit it received); when the running requests' KV outgrows it, the newest request is
preempted (its progress recomputed later), as vLLM's recompute preemption does.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServerParams:
    max_num_seqs: int
    kv_capacity_tokens: int
    single_tok_s: float  # decode tokens/s of one request running alone
    alpha: float  # throughput exponent: B requests make single_tok_s * B**alpha tokens/s
    prefill_cost: float  # service units per uncached prompt token (prefill is cheap per token)
    update_latency_s: float  # in-flight update: decoding pauses this long


@dataclass
class Request:
    rid: int
    kv_prompt: int  # prompt tokens this request holds in KV (shared prefixes split)
    prefill_work: float
    decode: int
    on_done: Callable[[Request], None]
    start: float = 0.0  # S at admission
    spans: list[tuple[int, int]] = field(default_factory=list)  # (version, tokens)

    @property
    def done_at(self) -> float:
        return self.start + self.prefill_work + self.decode


class Server:
    def __init__(self, params: ServerParams):
        self.p = params
        self.S = 0.0
        self.t = 0.0
        self.stall_until = 0.0
        self.version = 0
        self.marks: list[tuple[float, int]] = [(0.0, 0)]  # (S, version from there on)
        self.running: dict[int, Request] = {}
        self.waiting: deque[Request] = deque()
        self.heap: list[tuple[float, int]] = []
        self.kv_prompt = 0  # sum of running requests' prompt KV
        self.sum_start = 0.0  # sum of running requests' admission S
        self.preemptions = 0
        self.generated = 0
        self.update_latencies: list[float] = []
        self._ids = itertools.count()

    # --- time ------------------------------------------------------------------------------
    def rate(self) -> float:
        b = len(self.running)
        return self.p.single_tok_s * b ** (self.p.alpha - 1.0) if b else 0.0

    def advance(self, t: float) -> None:
        """Move the service counter to time t (no event in between)."""
        if t <= self.t:
            return
        busy_from = max(self.t, self.stall_until)
        if t > busy_from and self.running:
            self.S += self.rate() * (t - busy_from)
        self.t = t

    def kv_used(self) -> float:
        """Prompt KV plus one token per service unit received (prefill units included: they
        are few), O(1)."""
        return self.kv_prompt + len(self.running) * self.S - self.sum_start

    def next_event(self) -> float | None:
        """Time of the next completion, KV overflow or stall end (None when idle)."""
        if not self.running:
            return None
        if self.t < self.stall_until:
            return self.stall_until
        while self.heap and (
            self.heap[0][1] not in self.running
            or self.running[self.heap[0][1]].done_at != self.heap[0][0]
        ):
            heapq.heappop(self.heap)
        rate = self.rate()
        best = self.t + max(0.0, self.heap[0][0] - self.S) / rate
        # KV overflow: every running request adds one token per service unit
        room = self.p.kv_capacity_tokens - self.kv_used()
        return min(best, self.t + max(0.0, room) / (len(self.running) * rate) + 1e-9)

    # --- requests --------------------------------------------------------------------------
    def submit(self, kv_prompt: int, prefill_tokens: int, decode: int, on_done) -> None:
        req = Request(
            next(self._ids), kv_prompt, self.p.prefill_cost * prefill_tokens, decode, on_done
        )
        self.waiting.append(req)
        self._admit()

    def _admit(self) -> None:
        kv = None
        while self.waiting and len(self.running) < self.p.max_num_seqs:
            req = self.waiting[0]
            kv = self.kv_used() if kv is None else kv
            if self.running and kv + req.kv_prompt + 1 > self.p.kv_capacity_tokens:
                break
            self.waiting.popleft()
            req.start = self.S
            self.running[req.rid] = req
            self.sum_start += req.start
            self.kv_prompt += req.kv_prompt
            kv += req.kv_prompt
            heapq.heappush(self.heap, (req.done_at, req.rid))

    def step(self, t: float) -> None:
        """Process what happens at time t: completions, KV overflow, then admission."""
        self.advance(t)
        finished = []
        while self.heap and self.heap[0][0] <= self.S + 1e-6:
            _, rid = heapq.heappop(self.heap)
            req = self.running.get(rid)
            if req is not None and req.done_at <= self.S + 1e-6 and req not in finished:
                finished.append(req)
        for req in finished:
            del self.running[req.rid]
            self.sum_start -= req.start
            self.kv_prompt -= req.kv_prompt
            req.spans = self._spans(req.start + req.prefill_work, req.done_at)
            self.generated += req.decode
        while self.running and self.kv_used() > self.p.kv_capacity_tokens + 1e-6:
            victim = max(self.running.values(), key=lambda r: r.start)
            del self.running[victim.rid]
            self.sum_start -= victim.start
            self.kv_prompt -= victim.kv_prompt
            self.preemptions += 1
            self.waiting.appendleft(victim)  # recomputed from scratch when readmitted
            if not self.running:
                break
        self._admit()
        for req in finished:
            req.on_done(req)

    def _spans(self, s0: float, s1: float) -> list[tuple[int, int]]:
        """(version, tokens) for decode tokens made on [s0, s1)."""
        out: list[tuple[int, int]] = []
        total = round(s1 - s0)
        counted = 0
        for i, (mark, version) in enumerate(self.marks):
            end = self.marks[i + 1][0] if i + 1 < len(self.marks) else float("inf")
            lo, hi = max(s0, mark), min(s1, end)
            if hi > lo:
                n = round(hi - s0) - counted
                if n > 0:
                    out.append((version, n))
                    counted += n
        if counted < total:  # rounding: the last span takes the remainder
            out[-1] = (out[-1][0], out[-1][1] + total - counted) if out else (self.version, total)
        return out

    def update(self, t: float, version: int) -> None:
        """An in-flight update published at t: decoding pauses, then runs as `version`."""
        self.advance(t)
        start = max(t, self.stall_until)
        self.stall_until = start + self.p.update_latency_s
        self.update_latencies.append(self.stall_until - t)
        self.version = version
        if self.marks[-1][0] == self.S:
            self.marks[-1] = (self.S, version)
        else:
            self.marks.append((self.S, version))

    def snapshot(self, t: float, tokens_per_s: float) -> dict:
        """What `/art/metrics` (schema 2) would report at time t."""
        running, waiting = len(self.running), len(self.waiting)
        kv = self.kv_used() / self.p.kv_capacity_tokens
        full = running >= self.p.max_num_seqs or kv >= 0.95
        last_ms = 1000.0 * self.update_latencies[-1] if self.update_latencies else None
        return {
            "schema_version": 2,
            "snapshot_time": t,
            "age_s": 0.0,
            "idle": running == 0 and waiting == 0,
            "engine_step": 0,
            "num_running": running,
            "num_waiting": waiting,
            "num_waiting_for_capacity": waiting if full else 0,
            "num_waiting_deferred": 0,
            "max_num_seqs": self.p.max_num_seqs,
            "max_num_batched_tokens": 8192,
            "kv_cache_usage": min(1.0, kv),
            "preemptions_total": self.preemptions,
            "generation_tokens_total": self.generated,
            "generation_tokens_per_s": tokens_per_s,
            "slots": {
                "policy": {
                    "version": self.version,
                    "updates": len(self.update_latencies),
                    "failed_updates": 0,
                    "last_update_ms": last_ms,
                }
            },
        }
