"""Slots and the update coordinator of the API server.

A slot is a LoRA name given at start (`--lora-modules NAME=PATH`), at policy version 0. Its
state (version, committed path, digest, update counters, recent operation ids) lives in
EngineCore (`engine_core/slot_registry.py`), one identical registry per DP engine, so every
API-server process (`--api-server-count N`) reads the same thing: `refresh()` is one utility
call to engine 0, made whenever a reader needs the state (`/art/v1/slots`, `/art/metrics`, a
`slot@N` alias request), so an update that returned through one API server is seen by all.

An update: reserve on engine 0 (operation-id replay, `expected_version` compare-and-swap,
one update at a time across every API server), read and validate the adapter here once (in a
thread, off the event loop) and digest those bytes, then publish them to every engine
(`api_server/slot_publish.py`: stage everywhere, commit everywhere or nowhere), and finally
record the outcome on every engine (`art_finish_update`), which ends the reservation.

Updates of one API server are serialized by one lock. Each runs as its own task and the HTTP
handler awaits it through `asyncio.shield`: a client that disconnects or cancels does not
cancel an update that may already be committed in the engines, so the engines' registries
always end the update, and the lock is released when the task ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from art_protocol import digest as adapter_digest
from art_protocol.updates import UpdateRequest, UpdateRequestError, UpdateResponse
from art_vllm_plugin import compat, staging
from art_vllm_plugin.adapters import (
    AdapterError,
    AdapterSignature,
    read_and_validate,
    read_signature,
)
from art_vllm_plugin.api_server import slot_publish
from art_vllm_plugin.api_server.paths import PathPolicy, PathRefused

logger = logging.getLogger("vllm.art_plugin.slots")
_GAUGE = []
#: How long an update waits for another API server's update to end before giving up (503).
RESERVE_WAIT_S = slot_publish.STAGE_TIMEOUT_S + 60.0
_RESERVE_POLL_S = 0.01


def slot_version_gauge():
    """Prometheus gauge `art:slot_version{slot}` on vLLM's `/metrics` (created once)."""
    if not _GAUGE:
        from prometheus_client import Gauge

        _GAUGE.append(
            Gauge(
                "art:slot_version",
                "Policy version served by each art LoRA slot",
                labelnames=["slot"],
            )
        )
    return _GAUGE[0]


class UpdateError(Exception):
    """An update refused with an HTTP status; nothing was changed."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def parse_update(body) -> UpdateRequest:
    """The update body, or `UpdateError(400)` naming the field that is wrong."""
    try:
        return UpdateRequest.from_json(body)
    except UpdateRequestError as exc:
        raise UpdateError(400, str(exc)) from exc


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

    def public(self) -> dict:
        return {
            "slot": self.name,
            "version": self.version,
            "alias": f"{self.name}@{self.version}",
            "path": self.path,
            "digest": self.digest,
            "updated_at": self.updated_at,
        }


class SlotRegistry:
    def __init__(self, engine_client, serving_models, max_lora_rank: int, paths: PathPolicy):
        self.engine_client = engine_client
        self.paths = paths
        self.serving_models = serving_models
        self.max_lora_rank = max_lora_rank
        self.engines = slot_publish.engines_of(engine_client)
        self.local: dict[str, LocalSlot] = {}
        #: The registry as last read from engine 0 (`refresh()`).
        self.slots: dict[str, Slot] = {}
        #: Refused before a slot was known (bad body, unknown slot); per API server.
        self.failed_unattributed = 0
        #: LoRA modules that cannot be updated in flight: name -> why (e.g. a hub id).
        self.refused: dict[str, str] = {}
        self._lock = asyncio.Lock()
        self._registered = False
        #: Only this API server talks to the engines (vLLM's `client_count` is 1), so every
        #: change to their registry passes through here (see `refresh`).
        self.sole_api_server = compat.api_server_count(engine_client) == 1
        #: The copy in `slots` equals engine 0's registry (sole API server only).
        self._fresh = False
        #: Bumped when an update starts and ends: a registry read that straddles one is stale.
        self._generation = 0
        self.staging = staging.StagingConfig.default()
        now = time.time()
        for name, req in (serving_models.lora_requests if serving_models else {}).items():
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

    # --- reading the engines' registry ------------------------------------------------------
    async def _call(self, engine, method: str, *args):
        return await slot_publish.call(self.engine_client, engine, method, *args)

    async def _ensure_registered(self) -> None:
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
            await self._call(engine, "art_registry_register", start)
        self._registered = True

    def _apply(self, snapshot: dict) -> None:
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

    async def refresh(self) -> dict[str, Slot]:
        """Engine 0's registry: one utility call, which under load waits for the engine's
        current step. With a sole API server every change to the registry is an update made
        here, so after one read the copy stays exact until this server's next update starts
        or ends: `/art/metrics` and alias checks then cost no engine round trip."""
        if self.sole_api_server and self._fresh:
            return self.slots
        await self._ensure_registered()
        while True:
            generation = self._generation
            snapshot = await self._call(self.engines[0], "art_registry_snapshot")
            if not self.sole_api_server or generation == self._generation:
                break  # (a read that straddled an update here is read again)
        self._apply(snapshot)
        self._fresh = self.sole_api_server
        return self.slots

    def _registry_changing(self) -> None:
        self._generation += 1
        self._fresh = False

    async def engine_views(self) -> list[dict]:
        """Every engine's registry snapshot (engine order), engine 0's applied here."""
        await self._ensure_registered()
        snaps = await asyncio.gather(
            *(self._call(e, "art_registry_snapshot") for e in self.engines)
        )
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

    # --- updates ------------------------------------------------------------------------------
    async def update(self, req: UpdateRequest) -> dict:
        task = asyncio.ensure_future(self._update(req))
        return await asyncio.shield(task)

    async def _note_failure(self, token: str, slot: str | None) -> None:
        """Count a failed update (on every engine) and end its reservation, if any."""
        if slot is None or slot not in self.local:
            self.failed_unattributed += 1
            return
        with contextlib.suppress(Exception):  # an engine that died cannot count anything
            await slot_publish.call_all(
                self.engine_client, self.engines, "art_finish_update", token, slot, False
            )

    async def _update(self, req: UpdateRequest) -> dict:
        token = uuid.uuid4().hex
        self._registry_changing()
        try:
            await self._ensure_registered()
            return await self._update_locked(req, token)
        except BaseException:
            # Also for a bug or a cancellation: never leave a reservation behind.
            await self._note_failure(token, req.slot)
            raise
        finally:
            self._registry_changing()  # counters and versions: the next refresh reads them

    async def _reserve(self, req: UpdateRequest, token: str) -> dict:
        """Admission on engine 0; waits while another update (any API server) is running."""
        deadline = time.monotonic() + RESERVE_WAIT_S
        while True:
            try:
                res = await self._call(
                    self.engines[0],
                    "art_reserve_update",
                    token,
                    req.slot,
                    req.version,
                    req.expected_version,
                    req.operation_id,
                    req.fingerprint() if req.operation_id is not None else None,
                )
            except Exception as exc:
                raise UpdateError(
                    503, f"the engine failed to admit the update ({type(exc).__name__}: {exc})"
                ) from exc
            if res["ok"] or res["kind"] != "busy":
                return res
            if time.monotonic() > deadline:
                raise UpdateError(
                    503, f"{res['error']} for more than {RESERVE_WAIT_S:.0f} s; nothing changed"
                )
            await asyncio.sleep(_RESERVE_POLL_S)

    async def _update_locked(self, req: UpdateRequest, token: str) -> dict:
        t0 = time.perf_counter()
        name = req.slot
        if name in self.refused:
            raise UpdateError(400, f"{self.refused[name]}; nothing changed")
        local = self.local.get(name)
        if local is None:
            raise UpdateError(404, f"unknown slot {name!r}; slots: {sorted(self.local)}")
        current = self.slots[name].version
        try:
            resolved = str(self.paths.resolve(req.path))
        except PathRefused as exc:
            raise UpdateError(403, f"{exc}; slot {name!r} keeps serving version {current}") from exc
        async with self._lock:
            admitted = await self._reserve(req, token)
            if not admitted["ok"]:
                if admitted["kind"] == "replay":
                    return {**admitted["response"], "replayed": True}
                status = 404 if admitted["kind"] == "unknown" else 409
                raise UpdateError(status, f"{admitted['error']}; nothing changed")
            current = admitted["version"]
            keeps = f"slot {name!r} keeps serving version {current}"
            try:
                files = await asyncio.to_thread(
                    read_and_validate, resolved, name, local.reference, self.max_lora_rank
                )
            except AdapterError as exc:
                raise UpdateError(422, f"{exc}; {keeps}") from exc
            digest = await asyncio.to_thread(
                adapter_digest.digest_bytes, files.config, files.weights
            )
            if req.digest is not None and req.digest != digest:
                raise UpdateError(
                    422,
                    f"digest mismatch: the request says {req.digest}, the adapter at {resolved} "
                    f"is {digest} (a torn or partial export?); {keeps}",
                )
            t_validated = time.perf_counter()
            try:
                result = await slot_publish.publish(
                    self.engine_client,
                    self.engines,
                    token=token,
                    lora_int_id=local.lora_int_id,
                    slot=name,
                    files=files,
                    path=resolved,
                    digest=digest,
                    version=req.version,
                    current_version=current,
                    config=self.staging,
                )
            except slot_publish.PublishError as exc:
                raise UpdateError(exc.status, exc.message) from exc
            elapsed_ms = (time.perf_counter() - t0) * 1000.0
            response = UpdateResponse(
                slot=name,
                version=req.version,
                previous_version=current,
                digest=digest,
                operation_id=req.operation_id,
                step=result.step,
                receipts=result.receipts,
                elapsed_ms=elapsed_ms,
                engine_ms=result.engine_ms,
                stall_ms=result.stall_ms,
                resalted_waiting=result.resalted_waiting,
            ).to_json()
            finished = await slot_publish.call_all(
                self.engine_client,
                self.engines,
                "art_finish_update",
                token,
                name,
                True,
                req.operation_id,
                req.fingerprint() if req.operation_id is not None else None,
                response,
                elapsed_ms,
            )
            for e, r in zip(self.engines, finished, strict=True):
                if isinstance(r, BaseException):  # committed; only the bookkeeping failed
                    logger.warning("art: engine %d could not record update: %s", e.dp_rank, r)
            self._apply_committed(name, req.version, resolved, digest, elapsed_ms)
            logger.info(
                "art update slot=%s version=%d step=%d engines=%d wait+validate=%.1fms "
                "stage=%.1fms publish=%.1fms engine_stall=%.2fms",
                name,
                req.version,
                result.step,
                len(self.engines),
                (t_validated - t0) * 1000,
                result.stage_ms,
                (time.perf_counter() - t_validated) * 1000,
                result.stall_ms,
            )
            return response

    def _apply_committed(self, name, version, path, digest, elapsed_ms) -> None:
        slot = self.slots[name]
        slot.version, slot.path, slot.digest = version, path, digest
        slot.updated_at = time.time()
        slot.updates += 1
        slot.last_update_ms = elapsed_ms
        self._point_new_requests_at(name, path)
        slot_version_gauge().labels(slot=name).set(version)

    def _point_new_requests_at(self, name: str, path: str) -> None:
        """New requests carry the new path (what `/v1/models` shows). The weights never come
        from a request's path after an update: workers serve the committed copy they hold."""
        requests = self.serving_models.lora_requests if self.serving_models else {}
        if name in requests and requests[name].lora_path != path:
            requests[name] = compat.replace_lora_path(requests[name], path)
