"""The plugin is discovered through one entry point, `vllm.general_plugins: art`.

The `/art/*` routes and the metrics feed reach vLLM's endpoint and stat-logger plugin loading
only when `art` is selected: as entry points of those groups they would be instantiated (stat
logger) or warned about (endpoint) by every server that merely has the package installed.
Each selection case runs in a new process in which vLLM was imported and nothing else
happened (loading patches process-global vLLM objects): forks of one interpreter that imported
vLLM once (`support.vllm_forks`).
"""

import json
import textwrap
from importlib.metadata import entry_points

import pytest
from support.vllm_forks import Case, run_forked

GROUPS = ("vllm.general_plugins", "vllm.endpoint_plugins", "vllm.stat_logger_plugins")


def test_only_the_general_plugin_is_an_entry_point():
    found = {g: {ep.name: ep.value for ep in entry_points(group=g)} for g in GROUPS}
    assert found["vllm.general_plugins"].get("art") == "art_vllm_plugin:register_general"
    assert "art" not in found["vllm.endpoint_plugins"]
    assert "art" not in found["vllm.stat_logger_plugins"]


LOAD = textwrap.dedent(
    """
    import json
    from vllm.plugins import (
        DEFAULT_PLUGINS_GROUP, ENDPOINT_PLUGINS_GROUP, load_general_plugins,
    )
    import vllm.plugins
    from vllm.v1.metrics import loggers

    load_general_plugins()
    print(json.dumps({
        "general": sorted(vllm.plugins.load_plugins_by_group(DEFAULT_PLUGINS_GROUP)),
        "endpoint": {k: v.__name__ for k, v in
                     vllm.plugins.load_plugins_by_group(ENDPOINT_PLUGINS_GROUP).items()},
        "stat_logger": [f.__name__ for f in loggers.load_stat_logger_plugin_factories()],
    }))
    """
)


#: The selections loaded, each in a fork of its own (None: `VLLM_PLUGINS` unset).
SELECTIONS = ("art", None, "lora_filesystem_resolver")


@pytest.fixture(scope="module")
def loaded() -> dict:
    """What vLLM's plugin loading found, per selection."""
    cases = [Case(LOAD, {"VLLM_PLUGINS": s}) for s in SELECTIONS]
    done = run_forked(cases, ("vllm.plugins", "vllm.v1.metrics.loggers"))
    out = {}
    for selection, proc in zip(SELECTIONS, done, strict=True):
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[selection] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def test_selected_plugin_reaches_vllm_endpoint_and_stat_logger_loading(loaded):
    out = loaded["art"]
    assert out["general"] == ["art"]
    assert out["endpoint"] == {"art": "ArtEndpointPlugin"}
    assert out["stat_logger"] == ["ArtStatLogger"]


@pytest.mark.parametrize("vllm_plugins", [None, "lora_filesystem_resolver"])
def test_unselected_plugin_adds_no_endpoint_and_no_stat_logger(loaded, vllm_plugins):
    out = loaded[vllm_plugins]
    assert "art" not in out["endpoint"]
    assert "ArtStatLogger" not in out["stat_logger"]


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
