"""The API server's view of the slots: a cached copy of EngineCore's slot registry.

A slot is a LoRA name given at start (`--lora-modules NAME=PATH`), at policy version 0. Its
state (version, committed path, digest, update counters, recent operation ids) lives in
EngineCore (`engine_core/slot_registry.py`, the truth), one identical registry per DP engine,
so every API-server process (`--api-server-count N`) reads the same thing: `refresh()` is one
utility call to engine 0, made whenever a reader needs the state (`/art/v1/slots`,
`/art/metrics`, a `slot@N` alias request), so an update that returned through one API server
is seen by all. Updates themselves are driven by `api_server/update_coordinator.py`.

A slot blocked after an update that left its state unknown carries the reason (`blocked`),
shown by `/art/v1/slots` and used to answer its requests (`api_server/blocked_slots.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from art_protocol import digest as adapter_digest
from art_protocol.weight_updates import BASE_SLOT
from art_vllm_plugin import compat
from art_vllm_plugin.adapters import AdapterSignature, read_signature
from art_vllm_plugin.api_server import slot_publish
from art_vllm_plugin.api_server.metrics_feed import slot_version_gauge

logger = logging.getLogger("vllm.art_plugin.slots")


@dataclass
class LocalSlot:
    """What this API server knows of a slot by itself (same on every API server)."""

    name: str
    lora_int_id: int
    start_path: str
    start_digest: str
    reference: AdapterSignature


@dataclass
class Slot:
    """A slot as EngineCore's registry has it (the last `refresh()`)."""

    name: str
    lora_int_id: int
    path: str
    version: int
    digest: str
    updated_at: float
    updates: int = 0
    failed_updates: int = 0
    last_update_ms: float | None = None
    #: Why the slot is blocked (its requests are refused), None when it serves.
    blocked: str | None = None

    def public(self) -> dict:
        return {
            "slot": self.name,
            "version": self.version,
            "alias": f"{self.name}@{self.version}",
            "path": self.path,
            "digest": self.digest,
            "updated_at": self.updated_at,
            "blocked": self.blocked,
        }


class SlotView:
    def __init__(self, engine_client, serving_models):
        self.engine_client = engine_client
        self.serving_models = serving_models
        self.engines = slot_publish.engines_of(engine_client)
        self.local: dict[str, LocalSlot] = {}
        #: The registry as last read from engine 0 (`refresh()`).
        self.slots: dict[str, Slot] = {}
        #: Every API server's exact leases, from the same read (`engine_core/lease_book.py`).
        self.lease_book: dict = {"copies": {}, "leases": {}}
        #: The base weights' record from the same read (version, digest, updates, blocked).
        self.base: dict = {"version": 0}
        #: LoRA modules that cannot be updated in flight: name -> why (e.g. a hub id).
        self.refused: dict[str, str] = {}
        self._registered = False
        #: Only this API server talks to the engines (vLLM's `client_count` is 1), so every
        #: change to their registry passes through here (see `refresh`).
        self.sole_api_server = compat.api_server_count(engine_client) == 1
        #: The copy in `slots` equals engine 0's registry (sole API server only).
        self._fresh = False
        #: Bumped when an update starts and ends: a registry read that straddles one is stale.
        self._generation = 0
        now = time.time()
        for name, req in (serving_models.lora_requests if serving_models else {}).items():
            if name == BASE_SLOT:
                self.refused[name] = (
                    f"LoRA module {name!r}: the name is the base weights' (full-weight updates, "
                    "/art/v1/weights/update); give the module another name"
                )
                logger.warning("art: %s; it is served but refused for updates", self.refused[name])
                continue
            if not Path(req.lora_path).is_dir():
                # vLLM resolves a hub id itself (in the worker); updates need the slot's
                # reference adapter on local disk, so such a module serves but is not a slot.
                self.refused[name] = (
                    f"LoRA module {name!r} was started from {req.lora_path!r}, which is not a "
                    "local adapter directory (a hub id?); in-flight updates need one: start "
                    f"it with --lora-modules {name}=/path/to/adapter_dir"
                )
                logger.warning("art: %s; it is served but refused for updates", self.refused[name])
                continue
            local = LocalSlot(
                name=name,
                lora_int_id=req.lora_int_id,
                start_path=req.lora_path,
                start_digest=adapter_digest.digest_dir(req.lora_path),
                reference=read_signature(req.lora_path),
            )
            self.local[name] = local
            # Until the first refresh: the start state (what every engine registers).
            self.slots[name] = Slot(
                name, local.lora_int_id, local.start_path, 0, local.start_digest, now
            )

    async def call(self, engine, method: str, *args):
        return await slot_publish.call(self.engine_client, engine, method, *args)

    async def ensure_registered(self) -> None:
        """Every engine knows this API server's start slots (once)."""
        if self._registered:
            return
        start = [
            {
                "name": s.name,
                "lora_int_id": s.lora_int_id,
                "path": s.start_path,
                "digest": s.start_digest,
            }
            for s in self.local.values()
        ]
        for engine in self.engines:
            await self.call(engine, "art_registry_register", start)
        self._registered = True

    def _apply(self, snapshot: dict) -> None:
        self.lease_book = snapshot.get("leases") or {"copies": {}, "leases": {}}
        self.base = snapshot.get("base") or {"version": 0}
        for name, rec in snapshot["slots"].items():
            if name not in self.local:
                continue  # registered by an API server with other --lora-modules: not ours
            slot = Slot(**rec)
            old = self.slots.get(name)
            self.slots[name] = slot
            if old is None or old.path != slot.path:
                self._point_new_requests_at(name, slot.path)
            if old is None or old.version != slot.version:
                slot_version_gauge().labels(slot=name).set(slot.version)

    async def refresh(self, force: bool = False) -> dict[str, Slot]:
        """Engine 0's registry: one utility call, which under load waits for the engine's
        current step. With a sole API server every change to the registry is an update made
        here, so after one read the copy stays exact until this server's next update starts
        or ends: `/art/metrics` and alias checks then cost no engine round trip. `force`:
        read it even then (an engine may have changed it in the middle of an update)."""
        if self.sole_api_server and self._fresh and not force:
            return self.slots
        await self.ensure_registered()
        while True:
            generation = self._generation
            snapshot = await self.call(self.engines[0], "art_registry_snapshot")
            if not self.sole_api_server or generation == self._generation:
                break  # (a read that straddled an update here is read again)
        self._apply(snapshot)
        self._fresh = self.sole_api_server
        return self.slots

    def registry_changing(self) -> None:
        """An update starts or ends: the next `refresh` reads the engines again."""
        self._generation += 1
        self._fresh = False

    async def engine_views(self) -> list[dict]:
        """Every engine's registry snapshot (engine order), engine 0's applied here."""
        await self.ensure_registered()
        snaps = await asyncio.gather(*(self.call(e, "art_registry_snapshot") for e in self.engines))
        self._apply(snaps[0])
        return list(snaps)

    def export_versions(self) -> None:
        gauge = slot_version_gauge()
        for slot in self.slots.values():
            gauge.labels(slot=slot.name).set(slot.version)

    async def list(self) -> list[dict]:
        snaps = await self.engine_views()
        out = []
        for slot in self.slots.values():
            entry = slot.public()
            entry["engines"] = [
                {
                    "engine": e.dp_rank,
                    "version": snap["slots"][slot.name]["version"],
                    "digest": snap["slots"][slot.name]["digest"],
                }
                for e, snap in zip(self.engines, snaps, strict=True)
                if slot.name in snap["slots"]
            ]
            out.append(entry)
        return out

    def apply_committed(self, name, version, path, digest, elapsed_ms) -> None:
        """An update of `name` committed through this API server."""
        slot = self.slots[name]
        slot.version, slot.path, slot.digest = version, path, digest
        slot.updated_at = time.time()
        slot.updates += 1
        slot.last_update_ms = elapsed_ms
        slot.blocked = None  # committed on every engine: `finish` unblocked it there too
        self._point_new_requests_at(name, path)
        slot_version_gauge().labels(slot=name).set(version)

    def _point_new_requests_at(self, name: str, path: str) -> None:
        """New requests carry the new path (what `/v1/models` shows). The weights never come
        from a request's path after an update: workers serve the committed copy they hold."""
        requests = self.serving_models.lora_requests if self.serving_models else {}
        if name in requests and requests[name].lora_path != path:
            requests[name] = compat.replace_lora_path(requests[name], path)
