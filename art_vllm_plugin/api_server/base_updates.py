"""The API server's half of a full-weight update (`POST /art/v1/weights/update`).

The same steps and guarantees as a LoRA slot update (`update_coordinator`, `slot_publish`),
for the base weights under the registry key `BASE_SLOT`:

1. admit on engine 0 (`art_reserve_update`): `operation_id` replay, `expected_version`
   compare-and-swap on the base version, one base update at a time across API servers;
2. copy the trainer's safetensors directory to a fresh stage and check the copy against the
   served model (names, dtypes, shapes, finite values) and the request's digest
   (`base_files`): a bad update is refused (422) naming every problem, nothing changed;
3. stage on every worker of every DP engine (`art_stage_base_update`: the workers read the
   files into host memory off the step loop), wait for every marker;
4. commit on every engine, riding each engine's next step (the base version, label and cache
   salts change with the weights, between two steps); if any engine fails, the engines that
   committed revert (their workers read the previous weights again), so every engine ends on
   the old weights (500), or, when some worker could not restore, the base weights are
   blocked on every engine (503: every request refused until a full-weight update commits
   everywhere);
5. record the outcome on every engine (`art_finish_update`), which makes the commit final.

The committed stage stays on disk while its version is current: it is what a revert of the
next update reads (the workers keep no copy of the weights, `worker/base_weights.py`). The
previous version's stage is removed once the next one is final. Engines on another host than
this API server cannot read the stage; an update is refused (501) when there is one.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path

from art_protocol.updates import UpdateRequest
from art_protocol.weight_updates import BASE_SLOT
from art_vllm_plugin import staging
from art_vllm_plugin.api_server import base_files, slot_publish
from art_vllm_plugin.api_server.paths import PathRefused
from art_vllm_plugin.api_server.update_coordinator import (
    UpdateCoordinator,
    UpdateError,
    check_digest,
)

logger = logging.getLogger("vllm.art_plugin.slots")


def served_checkpoint(model: str) -> Path | None:
    """The served model's local checkpoint directory (what updates are checked against), or
    None when the model was not loaded from a local directory of safetensors."""
    path = Path(model)
    return path if path.is_dir() else None


class BaseUpdater:
    """Runs full-weight updates; one at a time on this API server (and across API servers,
    by engine 0's reservation)."""

    def __init__(self, coordinator: UpdateCoordinator, served_dir: Path | None, model: str):
        self.coordinator = coordinator
        self.view = coordinator.view
        self.engine_client = coordinator.engine_client
        self.engines = coordinator.engines
        self.served_dir = served_dir
        self.model = model
        self._lock = asyncio.Lock()
        #: The stage of the base version this server committed last (kept while current).
        self.current_dir: Path | None = None

    async def update(self, req: UpdateRequest) -> dict:
        """Run one update to its end, whatever happens to the client (as for slot updates)."""
        task = asyncio.ensure_future(self._update(req))
        return await asyncio.shield(task)

    async def _update(self, req: UpdateRequest) -> dict:
        token = uuid.uuid4().hex
        self.view.registry_changing()
        try:
            await self.view.ensure_registered()
            return await self._update_locked(req, token)
        except BaseException:
            await self.coordinator.note_failure(token, BASE_SLOT)  # ends the reservation
            raise
        finally:
            self.view.registry_changing()

    def _refuse_unsupported(self) -> None:
        if self.served_dir is None:
            raise UpdateError(
                501,
                f"full-weight updates need the served model as a local directory of "
                f"safetensors to check updates against; {self.model!r} is not one (serve the "
                "model from its local directory); nothing changed",
            )
        if remote := [e.dp_rank for e in self.engines if e.remote]:
            raise UpdateError(
                501,
                f"engines {remote} run on another host than this API server and cannot read "
                "its stage; full-weight updates need every engine on this host for now; "
                "nothing changed",
            )

    async def _update_locked(self, req: UpdateRequest, token: str) -> dict:
        t0 = time.perf_counter()
        self._refuse_unsupported()
        current = self.view.base.get("version", 0)
        try:
            resolved = self.coordinator.paths.resolve(req.path)
        except PathRefused as exc:
            raise UpdateError(
                403, f"{exc}; the base weights keep serving version {current}"
            ) from exc
        fingerprint = req.fingerprint() if req.operation_id is not None else None
        async with self._lock:
            admitted = await self.coordinator.reserve(req, token, fingerprint)
            if not admitted["ok"]:
                if admitted["kind"] == "replay":
                    return {**admitted["response"], "replayed": True}
                raise UpdateError(409, f"{admitted['error']}; nothing changed")
            current = admitted["version"]
            keeps = f"the base weights keep serving version {current}"
            source = f"the full weights at {resolved}"
            try:
                stage_dir = await asyncio.to_thread(
                    base_files.write_stage,
                    self.coordinator.staging,
                    Path(resolved),
                    req.version,
                    self.engines,
                )
            except base_files.WeightsRefused as exc:
                raise UpdateError(422, f"{exc}; {keeps}") from exc
            except staging.StagingRefused as exc:
                raise UpdateError(exc.status, f"{exc}; {keeps}") from exc
            committed = False
            try:
                result, digest = await self._check_and_publish(req, token, stage_dir, source, keeps)
                committed = True
            finally:
                if not committed:
                    await asyncio.to_thread(staging.remove, stage_dir)
            return await self._finish(
                req, token, fingerprint, current, digest, result, t0, stage_dir
            )

    async def _check_and_publish(self, req, token, stage_dir: Path, source: str, keeps: str):
        try:
            digest = await asyncio.to_thread(
                base_files.check_stage, stage_dir, self.served_dir, source
            )
        except base_files.WeightsRefused as exc:
            raise UpdateError(422, f"{exc}; {keeps}") from exc
        check_digest(req, source, digest, keeps)
        calls = [
            (
                "art_stage_base_update",
                token,
                str(stage_dir),
                req.version,
                str(staging.marker_dir(stage_dir, e.dp_rank)),
                digest,
            )
            for e in self.engines
        ]
        try:
            result = await slot_publish.stage_and_commit(
                self.engine_client,
                self.engines,
                token=token,
                stage_calls=calls,
                stage_dir=stage_dir,
                what=source,
                keeps=keeps,
                slot=BASE_SLOT,
                version=req.version,
                digest=digest,
                path=str(stage_dir),
                operation_id=req.operation_id,
            )
        except slot_publish.PublishError as exc:
            raise await self.coordinator.publish_failed(
                exc,
                req,
                "every request is refused (503) until a full-weight update commits on every engine",
            ) from exc
        return result, digest

    async def _finish(self, req, token, fingerprint, current, digest, result, t0, stage_dir):
        """Record the committed update on every engine (final: no revert any more), then
        drop the stage of the version it replaced."""
        response, elapsed_ms = await self.coordinator.record_committed(
            req, token, fingerprint, current, digest, result, t0
        )
        previous, self.current_dir = self.current_dir, stage_dir
        if previous is not None:
            await asyncio.to_thread(staging.remove, previous)
        logger.info(
            "art update base weights version=%d step=%d engines=%d total=%.1fms stage=%.1fms "
            "stall=%.2fms",
            req.version,
            result.step,
            len(self.engines),
            elapsed_ms,
            result.stage_ms,
            result.stall_ms,
        )
        return response
