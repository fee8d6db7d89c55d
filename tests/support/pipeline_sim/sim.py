"""A discrete-event Pipeline RL simulation: rollout workers -> inference server -> bounded
queue -> trainer -> in-flight updates, with an optional autotuner in the loop.

Workers each run one group at a time (its rollouts in parallel, multi-turn rollouts turn by
turn with tool latency between), drop zero-variance groups, and block on a full queue. The
trainer starts a step once `target_groups` groups are queued (or the queue is full), takes up
to `max_batch_groups`, discards groups holding a token older than the policy-age limit, packs
the rest with the project's prefix-tree packer (`art_protocol.packing.placement` through
`art_protocol.autotune.packing_estimate`), trains for `overhead + rows * seq_len /
train_tok_s`, saves the adapter, and publishes the next version to the server in flight.
The tuner (if any) sees what a real loop would give it: `/art/metrics`-shaped snapshots every
simulated second and one `StepRecord` per step.

A test harness for the tuner's logic, not a claim about GPU throughput.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from art_protocol.autotune import Autotuner, GroupShape, Settings, StepRecord, packed_rows
from art_protocol.policy_age import batch_factor, freshness

from .server import Server
from .workloads import REF_GROUPS, Lengths, Workload

SCORE_STEPS = 10
POLL_S = 1.0
STALL_S = 20_000.0  # a run without a step for this long is a bug in the harness


@dataclass
class Group:
    worker: int
    started: float
    prompt: int
    rollouts: list[dict]  # per rollout: turns left, own tokens, trainable spans
    pending: int
    done_at: float = 0.0
    put_wait: float = 0.0

    @property
    def shape(self) -> GroupShape:
        return GroupShape(self.prompt, tuple(r["own"] for r in self.rollouts))

    @property
    def trainable(self) -> int:
        return sum(n for r in self.rollouts for _, n in r["spans"])

    def oldest_version(self) -> int:
        return min(v for r in self.rollouts for v, _ in r["spans"])


@dataclass
class StepLog:
    step: int
    t_end: float
    groups: int
    rows: int
    accepted_tokens: int
    fresh_weight: float  # sum over trained tokens of exp(age / tau), for the score
    settings: Settings


@dataclass
class SimResult:
    workload: str
    steps: list[StepLog]
    decisions: list = field(default_factory=list)

    def score(self, last: int = SCORE_STEPS) -> float:
        """The seed's score over the last `last` steps: accepted trainable tokens per second
        x token-weighted freshness (tau 8) x batch factor (C 300, reference 8 groups)."""
        window = self.steps[-last:]
        start = self.steps[-last - 1].t_end if len(self.steps) > last else 0.0
        tokens = sum(s.accepted_tokens for s in window)
        if not tokens:
            return 0.0
        rate = tokens / (window[-1].t_end - start)
        fresh = tokens / sum(s.fresh_weight for s in window)
        groups = sum(s.groups for s in window) / len(window)
        return rate * fresh * batch_factor(groups, self.rpg, REF_GROUPS, self.rpg)

    rpg: int = 8


class Simulation:
    def __init__(
        self,
        workload: Workload,
        settings: Settings,
        seed: int,
        tuner: Autotuner | None = None,
        steps: int | None = None,
    ):
        self.w = workload
        self.settings = settings
        self.rng = np.random.default_rng(seed)
        self.tuner = tuner
        self.steps = steps or workload.steps
        self.t = 0.0
        self.server = Server(workload.server)
        self.events: list = []
        self._seq = itertools.count()
        self.queue: deque[Group] = deque()
        self.blocked: deque[Group] = deque()
        self.active: set[int] = set()
        self.version = 0
        self.busy = False
        self.last_end = 0.0
        self.stale = 0
        self.zero_var = 0
        self.logs: list[StepLog] = []
        self.gen_window: deque = deque()

    # --- event plumbing -----------------------------------------------------------------
    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self.events, (t, next(self._seq), fn, args))

    def run(self) -> SimResult:
        for w in range(self.settings.rollout_workers):
            self._start_worker(w)
        if self.tuner is not None:
            self.at(0.0, self._poll)
        while len(self.logs) < self.steps:
            server_t = self.server.next_event()
            if server_t is not None and (not self.events or server_t <= self.events[0][0]):
                self.t = server_t
                self.server.step(server_t)
                continue
            if not self.events:
                raise RuntimeError(f"{self.w.name}: simulation deadlocked at t={self.t:.1f}")
            t, _, fn, args = heapq.heappop(self.events)
            if t - self.last_end > STALL_S:
                raise RuntimeError(
                    f"{self.w.name}: no training step for {STALL_S:.0f}s "
                    f"simulated (queue {len(self.queue)}, blocked "
                    f"{len(self.blocked)}, settings {self.settings})"
                )
            self.t = t
            self.server.advance(t)
            fn(*args)
        return SimResult(
            self.w.name,
            self.logs,
            list(self.tuner.decisions) if self.tuner else [],
            rpg=self.w.rollouts_per_group,
        )

    def _draw(self, spec: Lengths) -> int:
        value = self.rng.lognormal(math.log(spec.median), spec.sigma)
        return int(min(spec.high, max(spec.low, round(value))))

    # --- workers ------------------------------------------------------------------------
    def _start_worker(self, w: int) -> None:
        self.active.add(w)
        self._start_group(w)

    def _start_group(self, w: int) -> None:
        if w >= self.settings.rollout_workers:  # retired by a smaller worker count
            self.active.discard(w)
            return
        rpg = self.w.rollouts_per_group
        group = Group(
            worker=w, started=self.t, prompt=self._draw(self.w.prompt), rollouts=[], pending=rpg
        )
        for _ in range(rpg):
            turns = int(self.rng.integers(self.w.turns[0], self.w.turns[1] + 1))
            rollout = {"turns": turns, "own": 0, "spans": [], "context": 0}
            group.rollouts.append(rollout)
            self._submit_turn(group, rollout, first=True)

    def _submit_turn(self, group: Group, rollout: dict, first: bool) -> None:
        decode = self._draw(self.w.completion)
        rpg = self.w.rollouts_per_group
        if first:  # the prompt is prefilled once per group and its KV shared
            kv, prefill = group.prompt // rpg + 1, group.prompt // rpg + 1
        else:
            kv, prefill = group.prompt // rpg + rollout["own"], rollout["context"]

        def done(req, group=group, rollout=rollout, decode=decode):
            rollout["spans"].extend(req.spans)
            rollout["own"] += decode
            rollout["turns"] -= 1
            if rollout["turns"] > 0:
                tool = self._draw(self.w.tool_tokens) if self.w.tool_tokens else 0
                rollout["own"] += tool
                rollout["context"] = decode + tool
                lo, hi = self.w.tool_latency_s
                self.at(
                    self.t + float(self.rng.uniform(lo, hi)),
                    self._submit_turn,
                    group,
                    rollout,
                    False,
                )
                return
            group.pending -= 1
            if group.pending == 0:
                self._group_done(group)

        self.server.submit(kv, prefill, decode, done)

    def _group_done(self, group: Group) -> None:
        group.done_at = self.t
        if self.rng.random() < self.w.zero_variance_p:
            self.zero_var += 1
            self._start_group(group.worker)
            return
        if len(self.queue) < self.settings.queue_capacity:
            self.queue.append(group)
            self._start_group(group.worker)
            self._maybe_train()
        else:
            self.blocked.append(group)

    def _unblock(self) -> None:
        while self.blocked and len(self.queue) < self.settings.queue_capacity:
            group = self.blocked.popleft()
            group.put_wait = self.t - group.done_at
            self.queue.append(group)
            self._start_group(group.worker)

    # --- trainer ------------------------------------------------------------------------
    def _maybe_train(self) -> None:
        s = self.settings
        if self.busy or len(self.queue) < min(s.target_groups, s.queue_capacity):
            return
        taken = [self.queue.popleft() for _ in range(min(len(self.queue), s.max_batch_groups))]
        batch = []
        for group in taken:
            if self.version - group.oldest_version() > self.w.policy_age_limit:
                self.stale += 1
            else:
                batch.append(group)
        self._unblock()
        if not batch:  # all stale: the unblocked groups may make the next batch
            self._maybe_train()
            return
        self.busy = True
        start = self.t
        rows = packed_rows([g.shape for g in batch], self.w.seq_len)
        busy = self.w.step_overhead_s + rows * self.w.seq_len / self.w.train_tok_s
        self.at(start + busy + self.w.save_s, self._step_done, batch, start, rows)

    def _step_done(self, batch: list[Group], start: float, rows: int) -> None:
        current = self.version
        tokens, weight, ages = 0, 0.0, []
        for group in batch:
            spans, pos = [], 0
            for r in group.rollouts:
                for v, n in r["spans"]:
                    spans.append({"start": pos, "end": pos + n, "version": v})
                    pos += n
            if pos:
                tokens += pos
                weight += pos / freshness(spans, current)
                ages.extend((current - s["version"], s["end"] - s["start"]) for s in spans)
        self.version += 1
        self.server.update(self.t, self.version)
        self.logs.append(
            StepLog(len(self.logs) + 1, self.t, len(batch), rows, tokens, weight, self.settings)
        )
        record = StepRecord(
            step=len(self.logs),
            wall_s=self.t - self.last_end,
            wait_s=start - self.last_end,
            rollout_s=sum(g.done_at - g.started for g in batch) / len(batch),
            groups=len(batch),
            packed_rows=rows,
            padding_tokens=max(
                0, rows * self.w.seq_len - sum(g.shape.unique_tokens for g in batch)
            ),
            stale_discards=self.stale,
            zero_variance_discards=self.zero_var,
            put_wait_s=sum(g.put_wait for g in batch) / len(batch),
            accepted_tokens=tokens,
            max_policy_age=float(max(a for a, _ in ages)) if ages else 0.0,
            mean_policy_age=sum(a * n for a, n in ages) / max(1, sum(n for _, n in ages)),
            shapes=tuple(g.shape for g in batch),
        )
        self.stale = self.zero_var = 0
        self.last_end = self.t
        self.busy = False
        if self.tuner is not None:
            self._apply(self.tuner.on_step(record))
        self._maybe_train()

    def _apply(self, settings: Settings) -> None:
        old, self.settings = self.settings, settings
        for w in range(old.rollout_workers, settings.rollout_workers):
            if w not in self.active:
                self._start_worker(w)
        self._unblock()
        self._maybe_train()

    def _poll(self) -> None:
        generated = self.server.generated
        self.gen_window.append((self.t, generated))
        while self.gen_window and self.gen_window[0][0] < self.t - 10.0:
            self.gen_window.popleft()
        span = self.t - self.gen_window[0][0]
        rate = (generated - self.gen_window[0][1]) / span if span > 0 else 0.0
        self.tuner.observe(self.server.snapshot(self.t, rate), fetched_at=self.t)
        self.at(self.t + POLL_S, self._poll)


def run_fixed(workload: Workload, settings: Settings, seed: int, steps: int | None = None):
    return Simulation(workload, settings, seed, steps=steps).run()


def run_tuned(
    workload: Workload, settings: Settings, seed: int, config, steps=None, profile_path=None
):
    sim = Simulation(workload, settings, seed, steps=steps)
    sim.tuner = Autotuner(config, settings, clock=lambda: sim.t, profile_path=profile_path)
    return sim.run()
