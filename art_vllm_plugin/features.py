"""The capability table: the plugin's features and whether each is really on in a server.

`GET /art/v1/capabilities` reports this table so a trainer can check, before it relies on a
behaviour, that the server it talks to has it. A feature's state comes from the running
server (`ServerFacts`, recorded on the API server's state by the endpoint plugin when the API
server starts), not from a constant: in-flight updates, for example, are off on a server
started without `--enable-lora`, and the report says why. Which hooks make the features
work: `art_vllm_plugin.install`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ServerFacts:
    """What the API server knows about its own configuration, at start."""

    lora_enabled: bool
    prefix_caching: bool
    api_key: bool
    #: CPUs EngineCore was confined to by the CPU layout, or None when it was left alone.
    cpu_layout_cpus: tuple[int, ...] | None = None
    #: Slots refused for updates (e.g. a hub id instead of a local directory): name -> reason.
    refused_slots: tuple[tuple[str, str], ...] = ()
    #: How routes are captured: "native" (vLLM MRV2), "worker" (the plugin's CPU worker hook),
    #: or None when the server was started without --art-routes.
    routes_capture: str | None = None
    #: vLLM's model runner in the workers: "v2" (Model Runner V2, the GPU default) or "v1".
    model_runner: str | None = None
    #: `--art-allow-unauthenticated`: without a key, state-changing routes are open to anyone.
    allow_unauthenticated: bool = False


@dataclass(frozen=True)
class Feature:
    name: str
    description: str
    #: None when the feature is on for `facts`, else the reason it is off.
    off_reason: Callable[[ServerFacts], str | None]


def _always(_: ServerFacts) -> str | None:
    return None


def _needs_lora(facts: ServerFacts) -> str | None:
    return None if facts.lora_enabled else "the server was started without --enable-lora"


def _needs_lora_and_prefix_cache(facts: ServerFacts) -> str | None:
    if not facts.lora_enabled:
        return "the server was started without --enable-lora"
    return None if facts.prefix_caching else "prefix caching is off (--no-enable-prefix-caching)"


def _needs_api_key(facts: ServerFacts) -> str | None:
    if facts.api_key:
        return None
    state_changes = (
        "open to anyone (--art-allow-unauthenticated)"
        if facts.allow_unauthenticated
        else "refused (403)"
    )
    return (
        "no API key is configured (--api-key / VLLM_API_KEY): reads and generation are open, "
        f"state-changing routes are {state_changes}"
    )


def _needs_cpu_layout(facts: ServerFacts) -> str | None:
    if facts.cpu_layout_cpus is not None:
        return None
    return "not applied: --art-cpu-layout off, not a CPU host, or enough cores (see docs/plugin.md)"


def _needs_routes(facts: ServerFacts) -> str | None:
    return None if facts.routes_capture else "the server was started without --art-routes"


_FEATURES: dict[str, Feature] = {}


def _declare(name: str, description: str, off_reason=_always) -> None:
    _FEATURES[name] = Feature(name, description, off_reason)


_declare("capabilities", "GET /art/v1/capabilities")
_declare("cli_plugin_flag", "`vllm serve --plugin art` selects the plugin")
_declare(
    "inflight_lora_update",
    "atomic in-place LoRA slot updates between engine steps",
    _needs_lora,
)
_declare(
    "adapter_push",
    "POST /art/v1/lora/update also takes the adapter's files (multipart/form-data), streamed "
    "into staging: the server needs no access to the trainer's directory",
    _needs_lora,
)
_declare(
    "policy_spans",
    "per-token policy-version spans on every choice, streaming chunks included",
)
_declare(
    "prefix_cache_salting",
    "prefix-cache salt derived from the slot's policy version",
    _needs_lora_and_prefix_cache,
)
_declare("exact_aliases", "model name slot@N serves exactly version N or is refused", _needs_lora)
_declare(
    "exact_leases",
    "POST /art/v1/leases pins version N of a slot as model slot@N while the slot moves on",
    _needs_lora,
)
_declare(
    "guarded_routes",
    "/art routes need the API key when one is set; without one, state-changing routes are "
    "refused unless --art-allow-unauthenticated",
    _needs_api_key,
)
_declare("metrics", "GET /art/metrics fast JSON snapshot")
_declare(
    "cpu_layout",
    "EngineCore shares the worker's core so the API server keeps one (small CPU hosts)",
    _needs_cpu_layout,
)
_declare(
    "moe_routes",
    "routed experts per token (exact for prefix-cached prompts), route_spans, and the binary "
    "application/vnd.art.routes body of /art/v1/completions and /art/v1/chat/completions",
    _needs_routes,
)


def snapshot(facts: ServerFacts | None) -> dict[str, dict[str, object]]:
    """Each feature's state: `enabled`, `description`, and `reason` when it is off (every
    feature is off, "not recorded yet", before the API server recorded its facts)."""
    out: dict[str, dict[str, object]] = {}
    for f in _FEATURES.values():
        reason = f.off_reason(facts) if facts is not None else "server state not recorded yet"
        entry: dict[str, object] = {"enabled": reason is None, "description": f.description}
        if reason is not None:
            entry["reason"] = reason
        out[f.name] = entry
    if facts is not None and facts.refused_slots and "inflight_lora_update" in out:
        out["inflight_lora_update"]["refused_slots"] = dict(facts.refused_slots)
    return out


def enabled_names(facts: ServerFacts | None) -> list[str]:
    return [name for name, entry in snapshot(facts).items() if entry["enabled"]]
