"""What the general-plugin entry point does in each vLLM process.

vLLM calls `vllm.general_plugins` entry points in the API server, EngineCore and every worker,
possibly more than once per process. `load()` is idempotent:

1. Always (selected or not) it adds `--plugin NAME[,NAME]` to the `vllm serve` parser, because
   the CLI parses arguments before any plugin is selected (see `art_vllm_plugin.cli`). The
   option is inert until used.
2. Only when the plugin is selected (`VLLM_PLUGINS` names `art`), it checks the vLLM version
   and activates the plugin's features for this process. Unselected, nothing else changes.
"""

from __future__ import annotations

import logging
import os

from art_vllm_plugin.selection import is_selected

logger = logging.getLogger("vllm.art_plugin")  # propagates to vLLM's handlers

_state = {"cli_hook": False, "activated": False}


def load() -> None:
    if not _state["cli_hook"]:
        from art_vllm_plugin.cli import install_plugin_option

        install_plugin_option()
        _state["cli_hook"] = True
    if is_selected():
        activate()


def activate() -> None:
    """Check the vLLM version and switch the plugin on in this process (once)."""
    if _state["activated"]:
        return
    from art_vllm_plugin import compat, features

    version = compat.require_supported_vllm()
    features.activate_all()
    _state["activated"] = True
    logger.info("art plugin active in pid %d (vLLM %s)", os.getpid(), version)


def is_active() -> bool:
    return _state["activated"]
