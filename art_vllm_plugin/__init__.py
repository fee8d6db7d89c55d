"""art: a vLLM plugin for Pipeline RL (in-flight LoRA slot updates, per-token policy spans).

This module holds only the entry-point callable named in pyproject.toml and the two plugin
classes vLLM receives when the plugin is selected. Importing it is cheap and imports nothing
from vLLM: vLLM imports it in every process whether or not the plugin is selected, and
"installed but not selected" must change nothing.

- `vllm.general_plugins` -> `register_general` (every vLLM process; idempotent), the only
  entry point. When `art` is selected it hands vLLM's endpoint and stat-logger plugin loading
  `ArtEndpointPlugin` (API server; the `/art/*` routes) and `ArtStatLogger` (API server; the
  metrics feed); see `art_vllm_plugin.plugin_loader` for why they are not entry points.
"""

from __future__ import annotations

from art_vllm_plugin.version import __version__


def register_general() -> None:
    """General-plugin entry point: see `art_vllm_plugin.plugin_loader.load`."""
    from art_vllm_plugin.plugin_loader import load

    load()


def __getattr__(name: str):
    # vLLM resolves the endpoint and stat-logger entry points to these classes by attribute;
    # resolving them lazily keeps `import art_vllm_plugin` free of vLLM imports.
    if name == "ArtEndpointPlugin":
        from art_vllm_plugin.api_server.endpoint_plugin import ArtEndpointPlugin

        return ArtEndpointPlugin
    if name == "ArtStatLogger":
        from art_vllm_plugin.api_server.stat_logger import ArtStatLogger

        return ArtStatLogger
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ArtEndpointPlugin", "ArtStatLogger", "__version__", "register_general"]
