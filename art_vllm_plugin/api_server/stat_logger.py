"""The `vllm.stat_logger_plugins` entry point: the feed behind the plugin's metrics.

vLLM calls `record()` once per engine step in the API server. When `VLLM_PLUGINS` is unset it
instantiates every installed stat-logger plugin, so an unselected plugin must cost nothing:
`record` is then the inherited no-op-sized early return.
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

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        if not self.active:
            return
        FEED.record(scheduler_stats, iteration_stats)

    def log_engine_initialized(self):
        pass
