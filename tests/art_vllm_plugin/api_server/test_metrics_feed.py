"""The `/art/metrics` feed: one entry per engine and their sum, from either source.

With data parallelism vLLM's stat logger hands the API server every engine's steps; before,
each overwrote one feed, so the snapshot was whichever engine stepped last (a drained engine
could hide a busy one, and the reverse). With several API servers the engines push their own
figures (`EngineFigures` rows), which replace what the stat logger saw. vLLM's real
`SchedulerStats` / `IterationStats` are used; no server (the served behaviour is
`test_metrics.py` and `test_dp_metrics.py`).
"""

from __future__ import annotations

import pytest
from vllm.v1.metrics.stats import IterationStats, PrefixCacheStats, SchedulerStats

from art_vllm_plugin.api_server.metrics_feed import SCHEMA_VERSION, MetricsFeed
from art_vllm_plugin.engine_figures import EngineFigures


def stats(running: int, waiting: int = 0, kv: float = 0.1, queries=0, hits=0) -> SchedulerStats:
    prefix = PrefixCacheStats()
    prefix.queries, prefix.hits = queries, hits
    return SchedulerStats(
        num_running_reqs=running,
        num_waiting_reqs=waiting,
        kv_cache_usage=kv,
        prefix_cache_stats=prefix,
    )


def tokens(n: int, preempted: int = 0) -> IterationStats:
    it = IterationStats()
    it.num_generation_tokens, it.num_preempted_reqs = n, preempted
    return it


def feed(engines: int = 2, max_num_seqs: int = 4) -> MetricsFeed:
    f = MetricsFeed()
    f.set_limits(max_num_seqs, 256)
    for e in range(engines):
        f.engine(e)
    return f


def test_each_engine_keeps_its_own_figures_and_the_top_level_is_their_sum():
    f = feed()
    f.record(0, stats(3, kv=0.5, queries=10, hits=5), tokens(3))
    f.record(1, stats(2, kv=0.1, queries=10, hits=0), tokens(2))
    f.record(0, stats(3, kv=0.5), tokens(3))  # engine 0 stepped last
    snap = f.snapshot([], 0)
    assert snap["schema_version"] == SCHEMA_VERSION == 4
    by_engine = {e["engine"]: e for e in snap["engines"]}
    assert by_engine[0]["num_running"] == 3 and by_engine[1]["num_running"] == 2
    assert by_engine[0]["engine_step"] == 2 and by_engine[1]["engine_step"] == 1
    assert by_engine[0]["generation_tokens_total"] == 6
    for name in ("num_running", "engine_step", "generation_tokens_total", "num_waiting"):
        assert snap[name] == sum(e[name] for e in snap["engines"]), name
    assert snap["max_num_seqs"] == 8 and by_engine[0]["max_num_seqs"] == 4
    assert snap["kv_cache_usage"] == pytest.approx(0.3)
    assert snap["prefix_cache_hit_rate"] == 5 / 20
    assert snap["idle"] is False


def test_an_engine_that_drained_reports_zero_running_while_another_steps():
    f = feed()
    f.record(0, stats(3), None)
    f.record(1, stats(2), None)
    f.record(1, stats(0), tokens(1))  # engine 1 drains and stops stepping
    f.record(0, stats(3), tokens(3))
    snap = f.snapshot([], 0)
    engine1 = snap["engines"][1]
    assert engine1["num_running"] == 0 and engine1["idle"] is True
    assert snap["num_running"] == 3 and snap["idle"] is False
    f.record(0, stats(0), None)
    snap = f.snapshot([], 0)
    assert snap["num_running"] == 0 and snap["idle"] is True
    assert all(e["num_running"] == 0 for e in snap["engines"])


def test_waiting_for_capacity_is_each_engines_own():
    f = feed(max_num_seqs=2)
    f.record(0, stats(2, waiting=3), None)  # at its sequence limit: 3 wait for capacity
    f.record(1, stats(1, waiting=1), None)  # below it: waiting for the next step only
    snap = f.snapshot([], 0)
    assert [e["num_waiting_for_capacity"] for e in snap["engines"]] == [3, 0]
    assert snap["num_waiting_for_capacity"] == 3 and snap["num_waiting"] == 4


def test_engines_are_listed_before_their_first_step():
    snap = feed(engines=2).snapshot([], 0)
    assert [e["engine"] for e in snap["engines"]] == [0, 1]
    assert snap["idle"] is True and snap["num_running"] == 0 and snap["max_num_seqs"] == 8


def row(engine: int, **kw) -> list:
    return EngineFigures(engine, **kw).row()


def test_pushed_figures_replace_recorded_ones_and_later_records_are_ignored():
    f = feed()
    f.record(1, stats(3), tokens(5))  # a part of engine 1's steps, as one API server saw them
    f.apply_row(row(1, step_time=1.0, steps=40, num_running=0, generation_tokens=100))
    f.record(1, stats(3), tokens(5))
    engine1 = f.snapshot([], 0)["engines"][1]
    assert (engine1["num_running"], engine1["engine_step"]) == (0, 40)
    assert engine1["generation_tokens_total"] == 100
    assert engine1["generation_tokens_per_s"] == 0.0  # the first push is the baseline
    f.apply_row(row(1, step_time=2.0, steps=50, num_running=1, generation_tokens=130))
    engine1 = f.snapshot([], 0)["engines"][1]
    assert engine1["generation_tokens_per_s"] == 30 / 10.0
    assert engine1["snapshot_time"] == 2.0


def test_registry_generation_is_known_only_from_pushes():
    f = feed()
    f.record(0, stats(1), None)
    assert f.registry_generation(0) is None
    f.apply_row(row(0, registry_generation=7))
    assert f.registry_generation(0) == 7


def test_a_row_of_another_format_is_refused():
    bad = row(0)
    bad[0] = 99
    with pytest.raises(ValueError, match="format 99"):
        EngineFigures.from_row(bad)
