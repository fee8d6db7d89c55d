"""What the API server knows: the plugin's state, one object per API-server process.

Created by the endpoint plugin when the app starts (`ApiServerState.create`), then reachable
two ways, both the same object: the `/art/*` routes read `request.app.state.art`; patched
methods of vLLM's serving classes (which never see the app) reach it through
`api_server_state(serving)`, because it hangs on the `OpenAIServingModels` every serving
object of the app shares (`serving.models`). Tests build a fresh one instead of resetting
module globals.

With several API servers (`--api-server-count N`) it also subscribes, once, to every engine's
figures (`follow_engines`: the engines push them into the metrics feed), and reads the slot
registry again only when engine 0's pushed registry generation moved (`registry_slots`).
"""

from __future__ import annotations

import time
from argparse import Namespace
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from art_vllm_plugin import compat, staging
from art_vllm_plugin.api_server import aliases, slot_publish
from art_vllm_plugin.api_server.adapter_stream import AdapterStreams
from art_vllm_plugin.api_server.auth import configured_keys
from art_vllm_plugin.api_server.base_updates import BaseUpdater, served_checkpoint
from art_vllm_plugin.api_server.body_limits import DEFAULT_MAX_BODY_BYTES
from art_vllm_plugin.api_server.leases import LeaseManager
from art_vllm_plugin.api_server.metrics_feed import FEED
from art_vllm_plugin.api_server.paths import PathPolicy
from art_vllm_plugin.api_server.pushed_copies import PushedCopies
from art_vllm_plugin.api_server.slot_view import Slot, SlotView
from art_vllm_plugin.api_server.stage_deadline import DEFAULT_STALL_S
from art_vllm_plugin.api_server.update_coordinator import UpdateCoordinator
from art_vllm_plugin.compat import figures as vllm_figures
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
    #: Full-weight updates (`/art/v1/weights/update`).
    base_updates: BaseUpdater
    #: LoRA updates whose adapter the trainer streams (`transfer` in `/art/v1/lora/update`).
    adapter_streams: AdapterStreams
    api_key_digests: list[bytes]
    #: The server's configuration as the capability table sees it (set once at start).
    facts: ServerFacts | None = None
    #: `--art-allow-unauthenticated`: without a key, state-changing routes are open (auth.py).
    allow_unauthenticated: bool = False
    #: `--art-max-body-bytes`: the largest body an `/art` route reads (body_limits.py).
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    #: Alias of a request in flight, by the request's own id (`request.request_id`, a fresh
    #: uuid unless the client sets one), for its stream generator. Not by `id(request)`: an
    #: entry left behind by a refused request would be found by a later, unrelated request
    #: object allocated at the same address.
    pending_aliases: dict[str, aliases.Alias] = field(default_factory=dict)
    _leases: LeaseManager | None = None
    #: Several API servers: this one receives every engine's figures (`follow_engines`).
    _following: bool = False
    #: Engine 0's pushed registry generation when `slots.slots` was last read from it.
    _slots_generation: int | None = None

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
        # Stages (and kept push copies) of servers that crashed go before this one stages.
        staging_config = staging.StagingConfig.create(
            getattr(args, "art_staging_dir", None), getattr(args, "art_max_adapter_bytes", None)
        )
        staging.sweep(staging_config.root)
        pushed_copies = PushedCopies()
        pushed_copies.sweep()
        updates = UpdateCoordinator(view, max_rank, paths, staging_config, pushed_copies)
        model = engine_client.vllm_config.model_config.model
        base_updates = BaseUpdater(
            updates,
            served_checkpoint(model),
            model,
            staging_budget=getattr(args, "art_weights_staging_bytes", None),
            stall_timeout_s=getattr(args, "art_weights_stall_timeout", None) or DEFAULT_STALL_S,
        )
        return cls(
            engine_client=engine_client,
            args=args,
            started_at=time.time(),
            serving_models=serving_models,
            slots=view,
            updates=updates,
            base_updates=base_updates,
            adapter_streams=AdapterStreams(updates, base_updates.stream_lock),
            api_key_digests=configured_keys(getattr(args, "api_key", None)),
            allow_unauthenticated=bool(getattr(args, "art_allow_unauthenticated", False)),
            max_body_bytes=int(getattr(args, "art_max_body_bytes", DEFAULT_MAX_BODY_BYTES)),
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

    async def follow_engines(self) -> None:
        """Several API servers: have every engine push its figures here from now on (once).

        Each engine answers the subscription with its figures as they are, so the first
        `/art/metrics` already reports every engine; later ones cost no engine round trip.
        With one API server there is nothing to do: it sees every engine's steps itself."""
        if self._following or compat.api_server_count(self.engine_client) == 1:
            return
        vllm_figures.listen_for_pushes(self.engine_client, FEED.apply_row)
        client = vllm_figures.api_client_index(self.engine_client)
        rows = await slot_publish.call_all(
            self.engine_client, self.slots.engines, "art_figures_subscribe", client
        )
        for row in rows:
            if isinstance(row, BaseException):
                raise row
            if row is not None:
                FEED.apply_row(row)
        self._following = True

    async def registry_slots(self) -> dict[str, Slot]:
        """The slots as engine 0's registry has them, from the cached copy while engine 0's
        pushed registry generation is the one it was read at (several API servers; with one,
        `SlotView.refresh` keeps its copy exact itself). A generation seen before a read is
        at most the read's own, so a later change always moves it."""
        seen = FEED.registry_generation(self.slots.engines[0].dp_rank)
        if seen is not None and seen == self._slots_generation:
            return self.slots.slots
        slots = await self.slots.refresh()
        self._slots_generation = seen
        return slots

    def resolve_alias(self, model: str | None) -> aliases.Alias | None:
        """The alias `model` names: a leased `slot@N` first, then a slot's current version;
        raises `AliasRefused` for an alias of a slot that is not at that version."""
        leased = self.leases.alias_for(model)  # any API server's lease (engine 0's book)
        if leased is not None:
            return leased
        return aliases.resolve(model, self.slots.slots)


def api_server_state(serving: Any) -> ApiServerState | None:
    """The state of the API server a vLLM serving object belongs to (None before the art
    endpoint plugin started, or for a serving object of another app)."""
    models = compat.serving_models_of(serving)
    return compat.attached_state(models) if models is not None else None
