"""What the API server knows: the plugin's state, one object per API-server process.

Created by the endpoint plugin when the app starts (`ApiServerState.create`), then reachable
two ways, both the same object: the `/art/*` routes read `request.app.state.art`; patched
methods of vLLM's serving classes (which never see the app) reach it through
`api_server_state(serving)`, because it hangs on the `OpenAIServingModels` every serving
object of the app shares (`serving.models`). Tests build a fresh one instead of resetting
module globals.
"""

from __future__ import annotations

import time
from argparse import Namespace
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from art_vllm_plugin import compat
from art_vllm_plugin.api_server import aliases
from art_vllm_plugin.api_server.auth import configured_keys
from art_vllm_plugin.api_server.leases import LeaseManager
from art_vllm_plugin.api_server.paths import PathPolicy
from art_vllm_plugin.api_server.slot_view import SlotView
from art_vllm_plugin.api_server.update_coordinator import UpdateCoordinator
from art_vllm_plugin.features import ServerFacts


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
class ApiServerState:
    engine_client: Any
    args: Namespace
    started_at: float
    serving_models: Any
    slots: SlotView
    updates: UpdateCoordinator
    api_key_digests: list[bytes]
    #: The server's configuration as the capability table sees it (set once at start).
    facts: ServerFacts | None = None
    #: Alias of a request in flight, by the request's own id (`request.request_id`, a fresh
    #: uuid unless the client sets one), for its stream generator. Not by `id(request)`: an
    #: entry left behind by a refused request would be found by a later, unrelated request
    #: object allocated at the same address.
    pending_aliases: dict[str, aliases.Alias] = field(default_factory=dict)
    _leases: LeaseManager | None = None

    @classmethod
    def create(cls, engine_client: Any, args: Namespace, app_state: Any) -> ApiServerState:
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
        view = SlotView(engine_client, serving_models)
        max_rank = compat.max_lora_rank(engine_client) if lora_enabled else 0
        view.export_versions()
        return cls(
            engine_client=engine_client,
            args=args,
            started_at=time.time(),
            serving_models=serving_models,
            slots=view,
            updates=UpdateCoordinator(view, max_rank, paths),
            api_key_digests=configured_keys(getattr(args, "api_key", None)),
        )

    def attach(self, app_state: Any) -> None:
        """Make this the app's state (`app.state.art`) and the serving objects'."""
        app_state.art = self
        if self.serving_models is not None:
            compat.attach_state(self.serving_models, self)

    @property
    def leases(self) -> LeaseManager:
        """This API server's exact leases (made on first use)."""
        if self._leases is None:
            self._leases = LeaseManager(self, self.serving_models)
        return self._leases

    @property
    def existing_leases(self) -> LeaseManager | None:
        return self._leases

    def resolve_alias(self, model: str | None) -> aliases.Alias | None:
        """The alias `model` names: a leased `slot@N` first, then a slot's current version;
        raises `AliasRefused` for an alias of a slot that is not at that version."""
        leased = self._leases.alias_for(model) if self._leases is not None else None
        if leased is not None:
            return leased
        return aliases.resolve(model, self.slots.slots)


def api_server_state(serving: Any) -> ApiServerState | None:
    """The state of the API server a vLLM serving object belongs to (None before the art
    endpoint plugin started, or for a serving object of another app)."""
    models = compat.serving_models_of(serving)
    return compat.attached_state(models) if models is not None else None
