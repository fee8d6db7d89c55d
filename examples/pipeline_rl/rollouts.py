"""Rollout workers: threads that keep sampling groups from the server while the trainer trains.

Pipeline RL: the workers never pause for an update. The server swaps the slot's adapter in
flight, and every completion's `policy_spans` say which version computed each token; the
trainer turns that into a policy age per token. A worker asks for one group per request
(`n = group_size`, the loop's sampling temperature, the sampled token's logprob), checks the
spans cover every token exactly once, scores the group and puts it on a bounded queue
(blocking when full: the time it blocks is reported to the autotuner). Each group carries the
temperature it was sampled at: the trainer divides its logits by it, so its logprobs and the
server's (`--logprobs-mode processed_logprobs`: after temperature) are of one
distribution. Light client only: httpx, no torch, no vLLM.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import numpy as np

from art_protocol.client import validate_spans


@dataclass
class Rollout:
    completion: list[int]
    logprobs: list[float]  # behaviour logprobs from the server, one per completion token
    spans: list[dict]  # policy_spans: [{start, end, slot, version}]
    reward: float


@dataclass
class Group:
    prompt: list[int]
    rollouts: list[Rollout]
    started: float  # first request sent (monotonic)
    finished: float  # response received
    temperature: float  # what the request sampled at (the trainer applies it to its logits)
    put_wait_s: float = 0.0


class GroupQueue:
    """A bounded FIFO of groups whose capacity the autotuner may change while it runs."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: deque[Group] = deque()
        self._cond = threading.Condition()
        self.closed = False

    def set_capacity(self, capacity: int) -> None:
        with self._cond:
            self.capacity = capacity
            self._cond.notify_all()

    def put(self, group: Group) -> bool:
        """Block while full; returns False if the queue closed meanwhile."""
        t0 = time.monotonic()
        with self._cond:
            while len(self._items) >= self.capacity and not self.closed:
                self._cond.wait(0.1)
            if self.closed:
                return False
            group.put_wait_s = time.monotonic() - t0
            self._items.append(group)
            self._cond.notify_all()
            return True

    def get(self, timeout_s: float) -> Group:
        with self._cond:
            deadline = time.monotonic() + timeout_s
            while not self._items:
                left = deadline - time.monotonic()
                if self.closed or left <= 0:
                    raise TimeoutError(f"no rollout group arrived within {timeout_s:.0f}s")
                self._cond.wait(min(left, 0.1))
            group = self._items.popleft()
            self._cond.notify_all()
            return group

    def __len__(self) -> int:
        return len(self._items)

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


@dataclass
class RolloutWorkers:
    """`workers` threads; thread i samples only while i < active() (the autotuner's knob)."""

    url: str
    slot: str
    queue: GroupQueue
    make_prompt: Callable[[np.random.Generator], list[int]]
    reward: Callable[[list[int]], float]
    latest_version: Callable[[], int]  # newest version the trainer published or is publishing
    group_size: int
    completion_len: int
    workers: int
    active: Callable[[], int]
    temperature: float = 1.0
    seed: int = 0
    full: bool = False  # the versions are the base weights' (full-weight updates)
    error: BaseException | None = None
    requests: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for i in range(self.workers):
            t = threading.Thread(target=self._run, args=(i,), name=f"rollout-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        self.queue.close()
        for t in self._threads:
            t.join(timeout=60)

    def _run(self, index: int) -> None:
        rng = np.random.default_rng([self.seed, index])
        with httpx.Client(base_url=self.url, timeout=120) as http:
            k = 0
            while not self._stop.is_set():
                if index >= self.active():
                    time.sleep(0.05)
                    continue
                try:
                    group = self._sample(http, rng, seed=self.seed * 1_000_003 + index * 10_007 + k)
                except BaseException as exc:  # surfaced by the trainer's next batch
                    if not self._stop.is_set():
                        self.error = exc
                        self.queue.close()
                    return
                k += 1
                if not self.queue.put(group):
                    return

    def _sample(self, http: httpx.Client, rng: np.random.Generator, seed: int) -> Group:
        prompt = self.make_prompt(rng)
        started = time.monotonic()
        resp = http.post(
            "/v1/completions",
            json={
                "model": self.slot,
                "prompt": prompt,
                "n": self.group_size,
                "max_tokens": self.completion_len,
                "temperature": self.temperature,
                "ignore_eos": True,
                "logprobs": 0,
                "return_token_ids": True,
                "seed": seed,
            },
        )
        resp.raise_for_status()
        self.requests += 1
        rollouts = []
        for choice in resp.json()["choices"]:
            ids = choice["token_ids"]
            latest = self.latest_version()
            spans = validate_spans(
                choice,
                len(ids),
                latest_version=latest,
                latest_base_version=latest if self.full else None,
            )
            logprobs = choice["logprobs"]["token_logprobs"]
            if len(logprobs) != len(ids):
                raise ValueError(f"{len(logprobs)} logprobs for {len(ids)} tokens")
            rollouts.append(
                Rollout(ids, [float(x) for x in logprobs], list(spans), self.reward(ids))
            )
        return Group(prompt, rollouts, started, time.monotonic(), self.temperature)
