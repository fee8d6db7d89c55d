"""The API server's half of an in-flight slot update: admit, validate, publish, record.

An update: reserve on engine 0 (operation-id replay, `expected_version` compare-and-swap,
one update of a slot at a time across every API server), read and validate the adapter here
once (in a thread, off the event loop) and digest those bytes, then publish them to every
engine (`api_server/slot_publish.py`: stage everywhere, commit everywhere or nowhere), and
finally record the outcome on every engine (`art_finish_update`), which ends the reservation.
The slot view (`api_server/slot_view.py`) is told when an update starts and ends, so its
cached copy of the registry is read again.

A push (`api_server/adapter_push.py`) arrives with its files already streamed into a staging
directory: the same steps follow, with the staged bytes read instead of the trainer's path, the
digest of those bytes in the `operation_id` fingerprint (a replay means the same bytes), and a
kept copy of them as the committed path (`api_server/pushed_copies.py`). A path update's
adapter over `--art-max-adapter-bytes` is refused (413) before it is read; one the staging
directory has no room for (507) before it is staged (`art_vllm_plugin.staging`).

The digest always comes from the bytes read here, whether or not the request carried one, so
every engine binds the version it commits to a digest (`engine_core/version_digests.py`).
An update that fails with the slot's state unknown (503) blocks the slot on every engine
until an update of it commits cleanly everywhere (`engine_core/blocked_slots.py`).

Updates of one slot are serialized by a lock per slot (and across API servers by engine 0's
reservation); updates of different slots run at the same time. Each runs as its own task and
the HTTP handler awaits it through `asyncio.shield`: a client that disconnects or cancels does
not cancel an update that may already be committed in the engines, so the engines' registries
always end the update, and the lock is released when the task ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from pathlib import Path

from art_protocol import digest as adapter_digest
from art_protocol.push import FILE_PARTS
from art_protocol.updates import UpdateRequest, UpdateRequestError, UpdateResponse
from art_protocol.weight_updates import BASE_SLOT
from art_vllm_plugin import staging
from art_vllm_plugin.adapters import (
    AdapterError,
    AdapterFiles,
    read_and_validate,
    validate_adapter_files,
)
from art_vllm_plugin.api_server import slot_publish
from art_vllm_plugin.api_server.paths import PathPolicy, PathRefused
from art_vllm_plugin.api_server.pushed_copies import PushedCopies
from art_vllm_plugin.api_server.slot_view import SlotView

logger = logging.getLogger("vllm.art_plugin.slots")
#: How long an update waits for another API server's update to end before giving up (503):
#: a LoRA update's stage ends within `STAGE_TIMEOUT_S`. A full-weight stage has no fixed end
#: while it progresses (`stage_deadline`), and renews its reservation meanwhile
#: (`slot_publish.RENEW_EVERY_S`): an update waiting behind it waits on while the reservation
#: was renewed within this long (engine 0 says since when: `held_s`).
RESERVE_WAIT_S = slot_publish.STAGE_TIMEOUT_S + 60.0
_RESERVE_POLL_S = 0.01


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


def check_digest(req: UpdateRequest, source: str, digest: str, keeps: str) -> None:
    """`UpdateError(422)` when the request names a digest and the bytes read have another."""
    if req.digest is not None and req.digest != digest:
        raise UpdateError(
            422,
            f"digest mismatch: the request says {req.digest}, {source} is {digest} "
            f"(a torn or partial export?); {keeps}",
        )


class UpdateCoordinator:
    def __init__(
        self,
        view: SlotView,
        max_lora_rank: int,
        paths: PathPolicy,
        staging_config: staging.StagingConfig | None = None,
        pushed_copies: PushedCopies | None = None,
    ):
        self.view = view
        self.engine_client = view.engine_client
        self.engines = view.engines
        self.paths = paths
        self.max_lora_rank = max_lora_rank
        #: Refused before a slot was known (bad body, unknown slot); per API server.
        self.failed_unattributed = 0
        #: One lock per slot: updates of a slot run one at a time, different slots at once.
        self._locks: dict[str, asyncio.Lock] = {}
        self.staging = staging_config or staging.StagingConfig.default()
        self.pushed_copies = pushed_copies or PushedCopies()

    async def update(
        self,
        req: UpdateRequest,
        pushed=None,
        *,
        token: str | None = None,
        fingerprint: str | None = None,
    ) -> dict:
        """Run one update to its end. `pushed`: the `adapter_push.PushedAdapter` received for
        it, whose staging directory this update owns from now on (removed when it ends).
        `token`, `fingerprint`: a reservation the caller already holds, and what the
        operation id was admitted with (a streamed adapter: `api_server/adapter_stream.py`)."""
        task = asyncio.ensure_future(self._update(req, pushed, token, fingerprint))
        return await asyncio.shield(task)

    def check_push(self, req: UpdateRequest) -> None:
        """What can be refused of a push from its `request` part alone, before its files
        arrive: a slot refused for updates (400) or unknown (404)."""
        if req.slot in self.view.refused:
            raise UpdateError(400, f"{self.view.refused[req.slot]}; nothing changed")
        if req.slot not in self.view.local:
            raise UpdateError(
                404, f"unknown slot {req.slot!r}; slots: {sorted(self.view.local)}; nothing changed"
            )

    async def note_failure(self, token: str, slot: str | None) -> None:
        """Count a failed update (on every engine) and end its reservation, if any."""
        if slot is None or (slot not in self.view.local and slot != BASE_SLOT):
            self.failed_unattributed += 1
            return
        with contextlib.suppress(Exception):  # an engine that died cannot count anything
            await slot_publish.call_all(
                self.engine_client, self.engines, "art_finish_update", token, slot, False
            )

    async def _update(self, req: UpdateRequest, pushed=None, token=None, fingerprint=None) -> dict:
        token = token or uuid.uuid4().hex
        self.view.registry_changing()
        try:
            await self.view.ensure_registered()
            return await self._update_locked(req, token, pushed, fingerprint)
        except BaseException:
            # Also for a bug or a cancellation: never leave a reservation behind.
            await self.note_failure(token, req.slot)
            raise
        finally:
            self.view.registry_changing()  # counters and versions: the next refresh reads them
            if pushed is not None:
                await asyncio.to_thread(pushed.discard)

    async def block(self, name: str, req: UpdateRequest, error: str) -> None:
        """Block slot `name` (or the base weights, `BASE_SLOT`) on every engine that answers
        (an engine that died serves nothing)."""
        results = await slot_publish.call_all(
            self.engine_client,
            self.engines,
            "art_block_slot",
            name,
            req.version,
            req.operation_id,
            error,
        )
        for e, r in zip(self.engines, results, strict=True):
            if isinstance(r, BaseException):
                logger.warning("art: engine %d could not block slot %s: %s", e.dp_rank, name, r)

    async def reserve(self, req: UpdateRequest, token: str, fingerprint: str | None) -> dict:
        """Admission on engine 0; waits while another update of the slot (any API server) is
        running."""
        deadline = time.monotonic() + RESERVE_WAIT_S
        while True:
            try:
                res = await self.view.call(
                    self.engines[0],
                    "art_reserve_update",
                    token,
                    req.slot,
                    req.version,
                    req.expected_version,
                    req.operation_id,
                    fingerprint,
                )
            except Exception as exc:
                raise UpdateError(
                    503, f"the engine failed to admit the update ({type(exc).__name__}: {exc})"
                ) from exc
            if res["ok"] or res["kind"] != "busy":
                return res
            if time.monotonic() > deadline and res.get("held_s", RESERVE_WAIT_S) >= RESERVE_WAIT_S:
                raise UpdateError(
                    503, f"{res['error']} for more than {RESERVE_WAIT_S:.0f} s; nothing changed"
                )
            await asyncio.sleep(_RESERVE_POLL_S)

    async def admit(self, req: UpdateRequest, token: str, fingerprint: str | None) -> dict:
        """`reserve` with its refusals raised (404 for an unknown slot, 409 otherwise; nothing
        changed). Not ok means a replayed operation: its earlier answer is in `replayed`."""
        admitted = await self.reserve(req, token, fingerprint)
        if admitted["ok"]:
            return admitted
        if admitted["kind"] == "replay":
            return {**admitted, "replayed": {**admitted["response"], "replayed": True}}
        status = 404 if admitted["kind"] == "unknown" else 409
        raise UpdateError(status, f"{admitted['error']}; nothing changed")

    async def publish_failed(
        self, exc: slot_publish.PublishError, req: UpdateRequest, refused: str
    ) -> UpdateError:
        """The answer to a publish that failed; when it left the state unknown, `req.slot` (a
        slot, or the base weights) is blocked on every engine first and the answer says what
        is `refused` until a clean update."""
        if exc.state_unknown:
            await self.block(req.slot, req, exc.message)
            return UpdateError(exc.status, f"{exc.message}; {refused}")
        return UpdateError(exc.status, exc.message)

    async def record_committed(
        self, req: UpdateRequest, token, fingerprint, current, digest, result, t0
    ) -> tuple[dict, float]:
        """The response of an update committed on every engine, recorded on every engine
        (`art_finish_update`: the commit is final, the operation id replays it, the
        reservation ends); (response, elapsed ms)."""
        elapsed_ms = (time.perf_counter() - t0) * 1000.0
        response = UpdateResponse(
            slot=req.slot,
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
            req.slot,
            True,
            req.operation_id,
            fingerprint,
            response,
            elapsed_ms,
        )
        for e, r in zip(self.engines, finished, strict=True):
            if isinstance(r, BaseException):  # committed; only the bookkeeping failed
                logger.warning("art: engine %d could not record update: %s", e.dp_rank, r)
        return response, elapsed_ms

    def _read_path(self, resolved: str, name: str, local) -> AdapterFiles:
        """The adapter at `resolved`, size-checked before it is read (413), then validated."""
        what = f"the adapter at {resolved}"
        sizes = {}
        for file in FILE_PARTS:
            with contextlib.suppress(OSError):  # the read names what is missing or unreadable
                sizes[file] = (Path(resolved) / file).stat().st_size
        self.staging.check_size(sizes, what)
        files = read_and_validate(resolved, name, local.reference, self.max_lora_rank)
        # The files may have grown between the stat and the read.
        self.staging.check_size({f: len(b) for f, b in files.as_files().items()}, what)
        return files

    def _read_pushed(self, pushed) -> tuple[AdapterFiles, str]:
        """The pushed bytes as staged, and their digest."""
        files = pushed.read()
        return files, adapter_digest.digest_bytes(files.config, files.weights)

    async def _update_locked(
        self, req: UpdateRequest, token: str, pushed=None, fingerprint: str | None = None
    ) -> dict:
        t0 = time.perf_counter()
        name = req.slot
        if name in self.view.refused:
            raise UpdateError(400, f"{self.view.refused[name]}; nothing changed")
        local = self.view.local.get(name)
        if local is None:
            raise UpdateError(404, f"unknown slot {name!r}; slots: {sorted(self.view.local)}")
        current = self.view.slots[name].version
        files = content = resolved = None
        if pushed is None:
            try:
                resolved = str(self.paths.resolve(req.path))
            except PathRefused as exc:
                raise UpdateError(
                    403, f"{exc}; slot {name!r} keeps serving version {current}"
                ) from exc
            source = f"the adapter at {resolved}"
        else:
            files, content = await asyncio.to_thread(self._read_pushed, pushed)
            source = "the pushed adapter"
        if fingerprint is None and req.operation_id is not None:
            fingerprint = req.fingerprint(content)
        async with self._locks.setdefault(name, asyncio.Lock()):
            admitted = await self.admit(req, token, fingerprint)
            if not admitted["ok"]:
                return admitted["replayed"]
            current = admitted["version"]
            keeps = f"slot {name!r} keeps serving version {current}"
            try:
                if pushed is None:
                    files = await asyncio.to_thread(self._read_path, resolved, name, local)
                else:
                    await asyncio.to_thread(
                        validate_adapter_files, files, name, local.reference, self.max_lora_rank
                    )
            except AdapterError as exc:
                raise UpdateError(422, f"{exc}; {keeps}") from exc
            except staging.StagingRefused as exc:
                raise UpdateError(exc.status, f"{exc}; {keeps}") from exc
            digest = content or await asyncio.to_thread(
                adapter_digest.digest_bytes, files.config, files.weights
            )
            check_digest(req, source, digest, keeps)
            if pushed is not None:
                try:
                    kept = await asyncio.to_thread(
                        self.pushed_copies.keep, name, req.version, files
                    )
                except OSError as exc:
                    refusal = staging.StagingConfig(self.pushed_copies.root).refusal_for(
                        exc, f"a copy of the pushed adapter {name}@{req.version}"
                    )
                    raise UpdateError(refusal.status, f"{refusal}; {keeps}") from exc
                resolved = str(kept)
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
                    operation_id=req.operation_id,
                    pushed_dir=pushed.stage_dir if pushed is not None else None,
                )
            except slot_publish.PublishError as exc:
                if pushed is not None:
                    await asyncio.to_thread(self.pushed_copies.discard, resolved)
                raise await self.publish_failed(
                    exc,
                    req,
                    f"requests on slot {name!r} are refused (503) until an update of it "
                    "commits on every engine",
                ) from exc
            self.pushed_copies.committed(name, resolved)
            response, elapsed_ms = await self.record_committed(
                req, token, fingerprint, current, digest, result, t0
            )
            self.view.apply_committed(name, req.version, resolved, digest, elapsed_ms)
            logger.info(
                "art update slot=%s version=%d step=%d engines=%d%s wait+validate=%.1fms "
                "stage=%.1fms publish=%.1fms engine_stall=%.2fms",
                name,
                req.version,
                result.step,
                len(self.engines),
                " pushed" if pushed is not None else "",
                (t_validated - t0) * 1000,
                result.stage_ms,
                (time.perf_counter() - t_validated) * 1000,
                result.stall_ms,
            )
            return response
