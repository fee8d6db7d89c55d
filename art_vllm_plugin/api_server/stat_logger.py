"""The stat logger behind the plugin's metrics feed (handed to vLLM when `art` is selected).

vLLM makes one per engine this API server manages (`engine_index`: its DP rank) and calls
`record()` once per engine step in the API server. Each logger feeds its own engine's entry,
so with data parallelism the engines no longer overwrite one another's figures
(`metrics_feed.py`). It is not an entry point: the general plugin hands it to vLLM's
stat-logger loading only when `art` is selected (an installed stat-logger entry point would
make vLLM force `log_stats` on for every server). `record` still returns early when
unselected, for direct use.
"""

from __future__ import annotations

from art_vllm_plugin import compat
from art_vllm_plugin.api_server.metrics_feed import FEED
from art_vllm_plugin.selection import is_selected

StatLoggerBase = compat.stat_logger_base()


class ArtStatLogger(StatLoggerBase):
    def __init__(self, vllm_config, engine_index: int = 0):
        self.engine_index = engine_index
        self.active = is_selected()
        if self.active:  # the limits /art/metrics reports (public SchedulerConfig fields)
            scheduler = vllm_config.scheduler_config
            FEED.set_limits(scheduler.max_num_seqs, scheduler.max_num_batched_tokens)
            FEED.engine(engine_index)  # listed from the start, before its first step

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        if not self.active:
            return
        FEED.record(self.engine_index, scheduler_stats, iteration_stats)

    def log_engine_initialized(self):
        pass
