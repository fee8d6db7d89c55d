"""The plugin is discovered through its three entry points, each named `art`."""

from importlib.metadata import entry_points

import pytest

GROUPS = {
    "vllm.general_plugins": "art_vllm_plugin:register_general",
    "vllm.endpoint_plugins": "art_vllm_plugin:ArtEndpointPlugin",
    "vllm.stat_logger_plugins": "art_vllm_plugin:ArtStatLogger",
}


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_entry_point_is_registered_as_art(group):
    found = {ep.name: ep.value for ep in entry_points(group=group)}
    assert found.get("art") == GROUPS[group]


def test_vllm_discovers_the_plugin_in_each_group(monkeypatch):
    from vllm.plugins import (
        DEFAULT_PLUGINS_GROUP,
        ENDPOINT_PLUGINS_GROUP,
        STAT_LOGGER_PLUGINS_GROUP,
        load_plugins_by_group,
    )

    monkeypatch.setenv("VLLM_PLUGINS", "art")
    for group in (DEFAULT_PLUGINS_GROUP, ENDPOINT_PLUGINS_GROUP, STAT_LOGGER_PLUGINS_GROUP):
        assert "art" in load_plugins_by_group(group), group


def test_entry_points_resolve_to_the_types_vllm_requires():
    from vllm.plugins.endpoint_plugins.interface import EndpointPlugin
    from vllm.v1.metrics.loggers import StatLoggerBase

    import art_vllm_plugin

    assert issubclass(art_vllm_plugin.ArtStatLogger, StatLoggerBase)
    plugin = art_vllm_plugin.ArtEndpointPlugin()
    assert isinstance(plugin, EndpointPlugin)
    assert plugin.name == "art"


def test_unselected_stat_logger_records_nothing(monkeypatch):
    import art_vllm_plugin
    from art_vllm_plugin.api_server.metrics_feed import FEED

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    logger = art_vllm_plugin.ArtStatLogger(vllm_config=None)
    logger.record(scheduler_stats=object(), iteration_stats=None)
    assert FEED.engine_steps == 0 and FEED.last_record_time is None
