"""What the general-plugin entry point does in each vLLM process.

vLLM calls `vllm.general_plugins` entry points in the API server, EngineCore and every worker,
possibly more than once per process. `load()` is idempotent:

1. Always (selected or not) it adds `--plugin NAME[,NAME]` to the `vllm serve` parser, because
   the CLI parses arguments before any plugin is selected (see `art_vllm_plugin.cli`). The
   option is inert until used.
2. Only when the plugin is selected (`VLLM_PLUGINS` names `art`), it checks the vLLM version
   and activates the plugin's features for this process. Unselected, nothing else changes.

Which hooks each step installs, in which order: `art_vllm_plugin.install`. The process is
active once they are all in place (`install.is_active`); no flag of its own is kept.

The `/art/*` routes (an `EndpointPlugin`) and the metrics feed (a `StatLoggerBase`) are handed
to vLLM's own plugin loading, `load_plugins_by_group`, for the endpoint and stat-logger groups,
only when the plugin is selected. They are deliberately not entry points of those groups:
with `VLLM_PLUGINS` unset vLLM instantiates every installed stat logger (and then forces
`log_stats` on, even with `--disable-log-stats`) and warns about every installed endpoint
plugin, so an installed but unselected plugin would change the server.
"""

from __future__ import annotations

import logging
import os

from art_vllm_plugin import install
from art_vllm_plugin.selection import PLUGIN_NAME, is_selected

logger = logging.getLogger("vllm.art_plugin")  # propagates to vLLM's handlers


def load() -> None:
    install.install_cli(on_select=activate)
    if is_selected():
        activate()


def activate() -> None:
    """Check the vLLM version and switch the plugin on in this process (once)."""
    if install.is_active():
        return
    from art_vllm_plugin import compat

    version = compat.require_supported_vllm()
    install.install_selected_process(plugin_handover=with_art_plugins)
    logger.info("art plugin active in pid %d (vLLM %s)", os.getpid(), version)


def is_active() -> bool:
    """Whether the plugin is switched on in this process (`install.is_active`)."""
    return install.is_active()


def with_art_plugins(original):
    """`load_plugins_by_group` that adds the art endpoint plugin and stat logger when selected."""
    from art_vllm_plugin import compat

    endpoint_group, stat_logger_group = compat.plugin_groups()

    def load_plugins_by_group(group: str):
        plugins = original(group)
        if is_selected() and group == endpoint_group:
            from art_vllm_plugin.api_server.endpoint_plugin import ArtEndpointPlugin

            plugins.setdefault(PLUGIN_NAME, ArtEndpointPlugin)
        elif is_selected() and group == stat_logger_group:
            from art_vllm_plugin.api_server.stat_logger import ArtStatLogger

            plugins.setdefault(PLUGIN_NAME, ArtStatLogger)
        return plugins

    return load_plugins_by_group
