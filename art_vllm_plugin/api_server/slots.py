"""Slots and the update coordinator of the API server.

A slot is a LoRA name given at start (`--lora-modules NAME=PATH`), at policy version 0. An
update reads and validates the adapter here once (in a thread, off the event loop), then
publishes those bytes: every worker stages them off the step loop, and one EngineCore utility
call swaps them in on every worker and bumps the version between the same two engine steps
(`art_vllm_plugin.api_server.slot_publish`, `art_vllm_plugin.engine_core.slot_updates`).

Updates are serialized by one lock. Each runs as its own task and the HTTP handler awaits it
through `asyncio.shield`: a client that disconnects or cancels does not cancel an update that
may already be committed in the engine, so the registry never disagrees with the engine, and
the lock is released when the task ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

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


@dataclass
class Slot:
    name: str
    lora_int_id: int
    path: str
    version: int
    updated_at: float
    reference: AdapterSignature
    updates: int = 0
    failed_updates: int = 0
    last_update_ms: float | None = None

    def public(self) -> dict:
        return {
            "slot": self.name,
            "version": self.version,
            "alias": f"{self.name}@{self.version}",
            "path": self.path,
            "updated_at": self.updated_at,
        }


class SlotRegistry:
    def __init__(self, engine_client, serving_models, max_lora_rank: int, paths: PathPolicy):
        self.engine_client = engine_client
        self.paths = paths
        self.serving_models = serving_models
        self.max_lora_rank = max_lora_rank
        self.slots: dict[str, Slot] = {}
        self.failed_unattributed = 0  # refused before a slot was known (bad body, unknown slot)
        #: LoRA modules that cannot be updated in flight: name -> why (e.g. a hub id).
        self.refused: dict[str, str] = {}
        self._lock = asyncio.Lock()
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
            self.slots[name] = Slot(
                name=name,
                lora_int_id=req.lora_int_id,
                path=req.lora_path,
                version=0,
                updated_at=now,
                reference=read_signature(req.lora_path),
            )

    def export_versions(self) -> None:
        gauge = slot_version_gauge()
        for slot in self.slots.values():
            gauge.labels(slot=slot.name).set(slot.version)

    def list(self) -> list[dict]:
        return [s.public() for s in self.slots.values()]

    async def update(self, name: str, path: str, version: int) -> dict:
        task = asyncio.ensure_future(self._counted_update(name, path, version))
        return await asyncio.shield(task)

    async def _counted_update(self, name: str, path: str, version: int) -> dict:
        try:
            return await self._update(name, path, version)
        except UpdateError:
            slot = self.slots.get(name)
            if slot is not None:
                slot.failed_updates += 1
            else:
                self.failed_unattributed += 1
            raise

    async def _update(self, name: str, path: str, version: int) -> dict:
        t0 = time.perf_counter()
        slot = self.slots.get(name)
        if name in self.refused:
            raise UpdateError(400, f"{self.refused[name]}; nothing changed")
        if slot is None:
            raise UpdateError(404, f"unknown slot {name!r}; slots: {sorted(self.slots)}")
        try:
            resolved = str(self.paths.resolve(path))
        except PathRefused as exc:
            raise UpdateError(
                403, f"{exc}; slot {name!r} keeps serving version {slot.version}"
            ) from exc
        async with self._lock:
            if version <= slot.version:
                raise UpdateError(
                    409,
                    f"version {version} for slot {name!r} is not newer than "
                    f"the current version {slot.version}; nothing changed",
                )
            try:
                files = await asyncio.to_thread(
                    read_and_validate, resolved, name, slot.reference, self.max_lora_rank
                )
            except AdapterError as exc:
                raise UpdateError(
                    422, f"{exc}; slot {name!r} keeps serving version {slot.version}"
                ) from exc
            t_validated = time.perf_counter()
            try:
                result = await slot_publish.publish(
                    self.engine_client,
                    lora_int_id=slot.lora_int_id,
                    slot=name,
                    files=files,
                    version=version,
                    current_version=slot.version,
                    config=self.staging,
                )
            except slot_publish.PublishError as exc:
                raise UpdateError(exc.status, exc.message) from exc
            slot.version = version
            slot.path = resolved
            slot.updated_at = time.time()
            slot.updates += 1
            slot.last_update_ms = (time.perf_counter() - t0) * 1000.0
            self._point_new_requests_at(name, resolved)
            slot_version_gauge().labels(slot=name).set(version)
            logger.info(
                "art update slot=%s version=%d step=%d wait+validate=%.1fms stage=%.1fms "
                "publish=%.1fms engine_stall=%.2fms",
                name,
                version,
                result.step,
                (t_validated - t0) * 1000,
                result.stage_ms,
                (time.perf_counter() - t_validated) * 1000,
                result.stall_ms,
            )
            return {
                "slot": name,
                "version": version,
                "step": result.step,
                "elapsed_ms": slot.last_update_ms,
                "engine_ms": result.engine_ms,
                "stall_ms": result.stall_ms,
                "resalted_waiting": result.resalted_waiting,
            }

    def _point_new_requests_at(self, name: str, path: str) -> None:
        """New requests carry the new path (what `/v1/models` shows). The weights never come
        from a request's path after an update: workers serve the committed copy they hold."""
        requests = self.serving_models.lora_requests
        requests[name] = compat.replace_lora_path(requests[name], path)
