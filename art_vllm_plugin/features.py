"""The plugin's features and whether each is enabled in this server.

`GET /art/v1/capabilities` reports this table so a trainer can check, before it relies on a
behaviour, that the server it talks to has it. A feature is listed from the start with
`enabled: False` until the code that provides it exists and is switched on.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Feature:
    name: str
    description: str
    enabled: bool


_FEATURES: dict[str, Feature] = {}


def _declare(name: str, description: str, enabled: bool) -> None:
    _FEATURES[name] = Feature(name, description, enabled)


_declare("capabilities", "GET /art/v1/capabilities", True)
_declare("cli_plugin_flag", "`vllm serve --plugin art` selects the plugin", True)
_declare("inflight_lora_update", "atomic in-place LoRA slot updates between engine steps", False)
_declare("policy_spans", "per-token policy-version spans on every completion choice", False)
_declare("prefix_cache_salting", "prefix-cache salt derived from the slot's policy version", False)
_declare("metrics", "GET /art/metrics fast JSON snapshot", False)


def activate_all() -> None:
    """Switch on, in this process, every feature that needs a per-process hook (none yet)."""


def snapshot() -> dict[str, dict[str, object]]:
    return {
        f.name: {"enabled": f.enabled, "description": f.description} for f in _FEATURES.values()
    }


def enabled_names() -> list[str]:
    return [f.name for f in _FEATURES.values() if f.enabled]
