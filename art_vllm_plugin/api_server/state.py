"""Per-app state of the art routes, kept on `app.state.art`."""

from __future__ import annotations

import time
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from art_vllm_plugin.api_server.auth import configured_keys
from art_vllm_plugin.api_server.paths import PathPolicy
from art_vllm_plugin.api_server.slots import SlotRegistry


class UnsupportedDataParallelMode(RuntimeError):
    """A DP mode in which this API server does not manage every engine."""


def refuse_partial_data_parallel(mode: str | None) -> None:
    """In-flight updates commit on every DP engine or none, so the API server must reach every
    engine. With external or hybrid load balancing each API server manages only its own
    (local) engines: refuse to start rather than update some engines and not others."""
    if mode in ("external", "hybrid"):
        raise UnsupportedDataParallelMode(
            f"the art plugin does not support {mode} data-parallel load balancing "
            f"(--data-parallel-{mode}-lb): in-flight LoRA updates must reach every DP engine "
            "from each API server, and here each API server manages only some of them. Use "
            "internal load balancing (one `vllm serve --data-parallel-size N`), or run one "
            "server per replica behind your load balancer and publish to all of them with "
            "art_protocol.client.Fleet"
        )


@dataclass
class ArtApiState:
    engine_client: Any
    args: Namespace
    started_at: float
    slots: SlotRegistry
    api_key_digests: list[bytes]

    @classmethod
    def create(cls, engine_client: Any, args: Namespace, app_state: Any) -> ArtApiState:
        from art_vllm_plugin import compat, plugin_loader
        from art_vllm_plugin.api_server import aliases, response_spans

        # The endpoint plugin only loads when selected; make sure the API process is active
        # even when selection came from VLLM_PLUGINS set after the general plugins loaded.
        plugin_loader.activate()
        serving_models = getattr(app_state, "openai_serving_models", None)
        refuse_partial_data_parallel(compat.dp_load_balancing_mode(engine_client.vllm_config))
        lora_enabled = engine_client.vllm_config.lora_config is not None
        start_paths = (
            [r.lora_path for r in serving_models.lora_requests.values()]
            if (serving_models is not None)
            else []
        )
        paths = PathPolicy.create(
            roots=getattr(args, "art_adapter_roots", None) or [],
            maps=getattr(args, "art_path_maps", None) or [],
            default_roots=[str(Path(p).resolve().parent) for p in start_paths if Path(p).is_dir()],
        )
        registry = SlotRegistry(
            engine_client,
            serving_models,
            compat.max_lora_rank(engine_client) if lora_enabled else 0,
            paths,
        )
        registry.export_versions()
        response_spans.install(registry)
        aliases.install_refresh(registry)  # outermost: the registry is re-read, then checked
        return cls(
            engine_client=engine_client,
            args=args,
            started_at=time.time(),
            slots=registry,
            api_key_digests=configured_keys(getattr(args, "api_key", None)),
        )
