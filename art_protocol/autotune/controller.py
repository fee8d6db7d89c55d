"""The controller a Pipeline RL loop holds: polls `/art/metrics`, collects step records into
windows, calls `decide`, saves the profile, and hands back the settings.

One line per training step in the loop:

    settings = tuner.on_step(StepRecord(...))   # the settings to run the next step with

and `/art/metrics` polled about once a second, either by the loop (`tuner.poll()`) or by the
controller's own daemon thread (`tuner.start_polling()`; an error it meets is raised by the
next `on_step`). `fetch` is any callable returning the snapshot as a dict (e.g.
`lambda: httpx.get(url, timeout=2).json()`), so this module imports no HTTP client.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path

from art_protocol.autotune.config import Settings, TunerConfig
from art_protocol.autotune.profile import load_profile, save_profile
from art_protocol.autotune.rules import Decision, decide
from art_protocol.autotune.window import (
    REQUIRED_METRICS,
    MetricsContractError,
    MetricsSample,
    StepRecord,
    check_snapshot,
    summarize,
)

_TRAIN_POINTS = 24  # (rows, busy) points kept for the step-cost fit
_MAX_SAMPLES = 4096  # metrics samples kept while no window closes (an hour at 1 s)


class Autotuner:
    def __init__(
        self,
        config: TunerConfig,
        settings: Settings,
        *,
        fetch: Callable[[], Mapping] | None = None,
        clock: Callable[[], float] = time.time,
        profile_path: str | Path | None = None,
    ):
        config.check(settings, "initial settings")
        self.config = config
        self.settings = settings
        self.fetch = fetch
        self.clock = clock
        self.profile_path = Path(profile_path) if profile_path else None
        self.decisions: list[Decision] = []
        self.run_first_step: int | None = None  # warm-up counts from here, also on resume
        self._records: list[StepRecord] = []
        self._samples: deque[MetricsSample] = deque(maxlen=_MAX_SAMPLES)
        self._last_seen: dict[str, float] = {}
        self._problems: list[str] = []
        self._train_points: deque = deque(maxlen=_TRAIN_POINTS)
        self._shapes: deque = deque(maxlen=config.shape_history)
        self._poll_error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def resume(cls, profile_path: str | Path, config: TunerConfig, **kwargs) -> Autotuner:
        """A tuner starting from a saved profile's settings (refused if they do not fit
        `config`). Its warm-up counts from the first step it sees, not the profile's."""
        settings, _ = load_profile(Path(profile_path), config)
        return cls(config, settings, profile_path=profile_path, **kwargs)

    # --- metrics -------------------------------------------------------------------------
    def observe(self, snapshot: Mapping, fetched_at: float | None = None) -> None:
        """Take one `/art/metrics` snapshot. Strict mode raises on a missing or malformed
        metric, naming it; hold mode records the problem and the window is degraded."""
        now = self.clock() if fetched_at is None else fetched_at
        try:
            check_snapshot(snapshot)
        except MetricsContractError as exc:
            if self.config.on_bad_metrics == "raise":
                raise
            self._problems.append(str(exc))
            for name in REQUIRED_METRICS:
                if isinstance(snapshot, Mapping) and snapshot.get(name) is not None:
                    self._last_seen[name] = now
            return
        for name in REQUIRED_METRICS:
            self._last_seen[name] = now
        self._samples.append(MetricsSample(now, dict(snapshot)))

    def poll(self) -> None:
        if self.fetch is None:
            raise RuntimeError("Autotuner.poll needs a fetch callable")
        self.observe(self.fetch())

    def start_polling(self) -> None:
        """Poll every `poll_interval_s` on a daemon thread until `stop_polling()`."""

        def loop():
            while not self._stop.wait(self.config.poll_interval_s):
                try:
                    self.poll()
                except BaseException as exc:  # surfaced by the next on_step
                    self._poll_error = exc
                    return

        self._stop.clear()
        self._thread = threading.Thread(target=loop, name="art-autotune-poll", daemon=True)
        self._thread.start()

    def stop_polling(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _freshness_problems(self, now: float) -> list[tuple[str, str]]:
        limit = 2 * self.config.poll_interval_s
        out = []
        for name in REQUIRED_METRICS:
            seen = self._last_seen.get(name)
            if seen is None:
                out.append((name, f"/art/metrics metric '{name}' was never received"))
            elif now - seen > limit:
                out.append(
                    (
                        name,
                        f"/art/metrics metric '{name}' is stale: last received "
                        f"{now - seen:.1f}s ago, limit {limit:.1f}s "
                        f"(2 x poll_interval_s)",
                    )
                )
        if self._samples:
            last = self._samples[-1]
            age = last.values["age_s"] + (now - last.fetched_at)
            if age > limit and not last.values["idle"]:
                out.append(
                    (
                        "snapshot_time",
                        f"/art/metrics snapshot_time is stale: the engine "
                        f"last reported a step {age:.1f}s ago with work pending, limit "
                        f"{limit:.1f}s",
                    )
                )
        return out

    # --- steps ---------------------------------------------------------------------------
    def on_step(self, record: StepRecord) -> Settings:
        """Record a finished training step; at the end of a window decide and save the
        profile. Returns the settings for the next step."""
        if self._poll_error is not None:
            error, self._poll_error = self._poll_error, None
            raise error
        if self.run_first_step is None:
            self.run_first_step = record.step
        self._records.append(record)
        if record.packed_rows:
            self._train_points.append((record.packed_rows, record.wall_s - record.wait_s))
        self._shapes.extend(record.shapes)
        since = record.step - self.run_first_step + 1
        if since <= self.config.warmup_steps:
            self._records.clear()  # warm-up steps do not enter a window
            self._samples.clear()
            return self.settings
        if len(self._records) < self.config.window_steps:
            return self.settings
        return self._decide()

    def _decide(self) -> Settings:
        now = self.clock()
        problems = list(self._problems)
        for metric, message in self._freshness_problems(now):
            if self.config.on_bad_metrics == "raise":
                raise MetricsContractError(metric, message)
            problems.append(message)
        window = summarize(
            self._records,
            list(self._samples),
            run_first_step=self.run_first_step,
            train_points=list(self._train_points),
            shapes=list(self._shapes),
            degraded=problems,
        )
        decision = decide(window, self.settings, self.config)
        self.decisions.append(decision)
        self.settings = decision.settings
        self._records.clear()
        last = self._samples[-1] if self._samples else None
        self._samples.clear()
        if last is not None:  # the last sample opens the next window's deltas
            self._samples.append(last)
        self._problems.clear()
        if self.profile_path is not None:
            save_profile(
                self.profile_path,
                self.settings,
                self.config,
                decision.step,
                [d.as_dict() for d in self.decisions],
            )
        return self.settings

    @property
    def last_decision(self) -> Decision | None:
        return self.decisions[-1] if self.decisions else None
