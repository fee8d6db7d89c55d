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
_declare("inflight_lora_update", "atomic in-place LoRA slot updates between engine steps", True)
_declare(
    "policy_spans",
    "per-token policy-version spans on every choice, streaming chunks included",
    True,
)
_declare("prefix_cache_salting", "prefix-cache salt derived from the slot's policy version", True)
_declare("exact_aliases", "model name slot@N serves exactly version N or is refused", True)
_declare("guarded_routes", "/art routes need the API key when one is set", True)
_declare("metrics", "GET /art/metrics fast JSON snapshot", True)


def activate_all() -> None:
    """Install the EngineCore and worker hooks (class patches, idempotent, any process).

    API-server hooks (response spans) are installed by the endpoint plugin, which only runs
    in the API server.
    """
    from art_vllm_plugin import compat
    from art_vllm_plugin.engine_core import slot_updates
    from art_vllm_plugin.worker import lora_slot_writer

    slot_updates.install(compat.engine_core_class())
    lora_slot_writer.install(compat.worker_base_class())


def snapshot() -> dict[str, dict[str, object]]:
    return {
        f.name: {"enabled": f.enabled, "description": f.description} for f in _FEATURES.values()
    }


def enabled_names() -> list[str]:
    return [f.name for f in _FEATURES.values() if f.enabled]
