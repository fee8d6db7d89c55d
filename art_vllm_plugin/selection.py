"""Whether the art plugin is selected in this process.

vLLM loads `vllm.general_plugins` and `vllm.stat_logger_plugins` entry points in every process
when `VLLM_PLUGINS` is unset. "Installed but not selected" must change nothing, so every entry
point first asks `is_selected()`: the plugin is selected when `VLLM_PLUGINS` names it, which
`vllm serve --plugin art` arranges for the API server and every process it starts.
"""

from __future__ import annotations

import os

PLUGIN_NAME = "art"
ENV_VAR = "VLLM_PLUGINS"


def selected_names() -> list[str]:
    raw = os.environ.get(ENV_VAR)
    if raw is None:
        return []
    return [name.strip() for name in raw.split(",") if name.strip()]


def is_selected() -> bool:
    return PLUGIN_NAME in selected_names()


def select(names: list[str]) -> list[str]:
    """Add `names` to VLLM_PLUGINS (keeping what is there, no duplicates); returns the list.

    Processes started afterwards (EngineCore, workers) inherit the variable, so they load the
    same plugins as the API server.
    """
    merged = selected_names()
    for name in names:
        if name not in merged:
            merged.append(name)
    os.environ[ENV_VAR] = ",".join(merged)
    return merged
