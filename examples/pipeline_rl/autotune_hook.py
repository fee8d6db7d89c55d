"""`--autotune`: the loop's knobs moved online by `art_protocol.autotune` (issue 17 item 3).

The tuner polls the real server's `/art/metrics` once a second on its own thread and gets one
`StepRecord` per training step from the loop; after its warm-up, every `window_steps` steps it
decides the rollout workers (active worker threads), the groups per step (target, min, max)
and the queue capacity. The loop applies the settings before the next step and prints the
decision (or "hold"/"warm-up") on the step's line.

Metrics contract: `--autotune-on-bad-metrics raise` (the library's default) stops the loop with
the tuner's error naming a missing or stale `/art/metrics` field. The example defaults to the
opt-in "hold": on a loaded 2-core host a `/art/metrics` answer can take seconds; the loop keeps
training, the tuner keeps its settings for that window and the step line says "degraded" with
the reason. A poll that fails (timeout, connection) is skipped, so the metric goes stale and
the decision reports exactly that, instead of the poll thread's error stopping the loop.
"""

from __future__ import annotations

import threading

import httpx

from art_protocol.autotune import Autotuner, GroupShape, Settings, StepRecord, TunerConfig


class LoopTuner:
    def __init__(self, cfg, url: str):
        self.cfg = cfg
        self._http = httpx.Client(base_url=url, timeout=10)
        config = TunerConfig(
            max_rollout_workers=cfg.max_rollout_workers,
            policy_age_limit=cfg.max_policy_age,
            seq_len=cfg.seq_len,
            rollouts_per_group=cfg.group_size,
            max_batch_ceiling=16,
            max_queue_capacity=32,
            warmup_steps=3,
            window_steps=3,
            on_bad_metrics=cfg.autotune_on_bad_metrics,
            seed=cfg.seed,
        )
        groups = cfg.groups_per_step
        self.tuner = Autotuner(
            config,
            Settings(
                rollout_workers=cfg.rollout_workers,
                min_batch_groups=max(1, groups // 2),
                max_batch_groups=groups * 2,
                target_groups=groups,
                queue_capacity=cfg.queue_capacity,
            ),
            profile_path=cfg.path / "autotune_profile.json",
        )
        self.poll_failures = 0
        self._stop = threading.Event()
        self._poll()
        self._thread = threading.Thread(target=self._poll_loop, name="autotune-poll", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        try:
            resp = self._http.get("/art/metrics")
            resp.raise_for_status()
        except httpx.HTTPError:
            self.poll_failures += 1  # skipped: the metrics age, the decision says so
            return
        self.tuner.observe(resp.json())

    def _poll_loop(self) -> None:
        while not self._stop.wait(self.tuner.config.poll_interval_s):
            self._poll()

    def step(self, rec: dict, accepted, packed, settings: dict, queue) -> str:
        """Feed one step; apply the (possibly new) settings; return what to print."""
        rollout_s = [g.rollout_s for g in accepted]
        put_wait = [g.put_wait_s for g in accepted]
        shapes = [
            GroupShape(len(g.prompt), tuple(len(m.completion) for m in g.members)) for g in accepted
        ]
        before = len(self.tuner.decisions)
        new = self.tuner.on_step(
            StepRecord(
                step=rec["step"],
                wall_s=rec["wall_s"],
                wait_s=min(rec["wait_s"], rec["wall_s"]),
                rollout_s=sum(rollout_s) / len(rollout_s),
                groups=rec["groups"],
                packed_rows=rec["packed_rows"],
                padding_tokens=rec["packed_rows"] * self.cfg.seq_len - rec["packed_tokens"],
                stale_discards=rec["dropped_stale_groups"],
                zero_variance_discards=rec["dropped_zero_var"],
                put_wait_s=sum(put_wait) / len(put_wait),
                accepted_tokens=rec["accepted_tokens"],
                max_policy_age=float(rec["age_max"]),
                mean_policy_age=rec["age_mean"],
                shapes=shapes,
            )
        )
        settings["workers"] = new.rollout_workers
        settings["groups"] = new.target_groups
        queue.set_capacity(new.queue_capacity)
        rec["settings"] = new.as_dict()
        if len(self.tuner.decisions) == before:
            return "warm-up" if self._warming(rec["step"]) else "collecting window"
        decision = self.tuner.decisions[-1]
        moves = ", ".join(f"{k} {a}->{b}" for k, (a, b) in decision.changed.items())
        if decision.degraded:
            why = "; ".join(str(v) for v in decision.reasons.values())[:160]
            return f"hold (degraded: {why})"
        return moves or "hold"

    def _warming(self, step: int) -> bool:
        first = self.tuner.run_first_step or step
        return step - first + 1 <= self.tuner.config.warmup_steps

    def decisions(self) -> list[dict]:
        return [
            {"step": d.step, "changed": d.changed, "reasons": d.reasons, "degraded": d.degraded}
            for d in self.tuner.decisions
        ]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._http.close()


def make_tuner(cfg, url: str) -> LoopTuner:
    return LoopTuner(cfg, url)
