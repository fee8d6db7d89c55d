"""Exact leases: pin an immutable copy of a slot's version N so `slot@N` keeps serving it.

Why: evaluation or checkpoint scoring must run on exactly version N while the trainer keeps
publishing N+1, N+2, ... to the slot. Without a lease `slot@N` is refused (409) as soon as the
slot moves on. A lease copies version N's adapter files (the bytes its committed path holds,
checked against the digest recorded when it was committed) to a private directory and loads
them through vLLM's normal `add_lora` path as a separate LoRA id named `slot@N`, pinned in the
CPU LoRA cache so it is never evicted from memory. It takes one of the `--max-loras` device
slots only while it is scheduled, like any LoRA, so requests on more adapters than
`--max-loras` wait for a slot instead of failing. Requests naming `slot@N` then resolve to
that id (`aliases.resolve`), and EngineCore labels the id with version N
(`engine_core/lease_versions.py`), so every token's `policy_spans` say N (the span's `slot` is
the lease's model name, `slot@N`).

Lifecycle: `POST /art/v1/leases {"slot", "version", "ttl_s"}` -> lease (id, model, expiry);
several leases of one version share one pinned copy. `DELETE /art/v1/leases/{id}` or expiry
releases a lease; when the last lease of a copy goes, the name stops resolving at once, and
the LoRA is removed once no request that uses it is left in the scheduler.

Errors: 404 unknown slot, or version N not available (never committed on this server, its
committed path gone, or its files changed since); 403 when a file of its committed directory
now leads out of that directory and every allowed adapter root (`PathPolicy.check_files`: no
such file is opened); 429 when no LoRA
capacity is left (every adapter, slots and leases, stays resident: at most `max_cpu_loras`);
400 bad body.

Copies live in a server-private directory (`tempfile.mkdtemp`: mode 0700, an unguessable
name, removed at exit), each copy in a 0700 directory of its own with 0600 files: other users
of the host can neither read a policy's weights nor swap them under the server.

Teardown never leaks the copy's pinned CPU-cache slot: an engine that fails to drop the label
is logged and the LoRA is removed all the same (removing it drops the pin); the removal is
retried, and until it succeeds the copy keeps counting against capacity (`tearing_down`).

Versions are remembered as this API server sees them committed (`observe`, called around every
update): path and digest per version, the last `HISTORY_PER_SLOT` of each slot. Leases live
in this API server process (`ApiServerState.leases`, made on first use); with
`--api-server-count > 1` they are refused (a lease made through one API server would not exist
in the others).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import inspect
import logging
import os
import secrets
import shutil
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from art_protocol.digest import digest_bytes, digest_dir
from art_vllm_plugin import compat
from art_vllm_plugin.adapters import AdapterError, read_adapter_files
from art_vllm_plugin.api_server.aliases import Alias
from art_vllm_plugin.api_server.paths import PathRefused

logger = logging.getLogger("vllm.art_plugin.leases")

#: Committed versions remembered per slot (the oldest is forgotten first).
HISTORY_PER_SLOT = 64
#: Longest lease accepted; renew by taking a new one.
MAX_TTL_S = 7 * 24 * 3600.0
#: How often a released copy re-checks that no request uses it any more.
_UNPIN_POLL_S = 0.05
#: Attempts at removing a released copy's LoRA (and so its pin), and the pause between them.
_REMOVE_TRIES = 5
_REMOVE_RETRY_S = 0.5


class LeaseError(Exception):
    """A lease request refused with an HTTP status; nothing changed."""

    def __init__(self, status: int, message: str, **extra: Any):
        super().__init__(message)
        self.status = status
        self.message = message
        self.extra = extra


@dataclass(frozen=True)
class CommittedVersion:
    slot: str
    version: int
    path: str
    digest: str | None  # None when it could not be read at the time


@dataclass
class PinnedCopy:
    """One immutable copy of a slot version, loaded as its own LoRA id."""

    slot: str
    version: int
    lora_int_id: int
    path: str  # private copy of the adapter files
    digest: str
    leases: set[str] = field(default_factory=set)

    @property
    def name(self) -> str:
        return f"{self.slot}@{self.version}"


@dataclass
class Lease:
    id: str
    copy: PinnedCopy
    ttl_s: float
    created_at: float
    expires_at: float

    def public(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "slot": self.copy.slot,
            "version": self.copy.version,
            "model": self.copy.name,
            "lora_int_id": self.copy.lora_int_id,
            "digest": self.copy.digest,
            "ttl_s": self.ttl_s,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
        }


def parse_body(body: Any) -> tuple[str, int, float]:
    if not isinstance(body, dict):
        raise LeaseError(400, 'body must be a JSON object {"slot", "version", "ttl_s"}')
    slot, version, ttl = body.get("slot"), body.get("version"), body.get("ttl_s")
    if not isinstance(slot, str) or not slot:
        raise LeaseError(400, f"'slot' must be a non-empty string, got {slot!r}")
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise LeaseError(400, f"'version' must be a non-negative integer, got {version!r}")
    if not isinstance(ttl, int | float) or isinstance(ttl, bool) or not 0 < ttl <= MAX_TTL_S:
        raise LeaseError(400, f"'ttl_s' must be a number in (0, {MAX_TTL_S:.0f}], got {ttl!r}")
    return slot, version, float(ttl)


async def _maybe_await(value):
    return await value if inspect.isawaitable(value) else value


class LeaseManager:
    """The leases of one API server (see the module docstring)."""

    def __init__(self, art_state: Any, serving_models: Any):
        self.art = art_state
        self.engine_client = art_state.engine_client
        self.serving_models = serving_models
        self.history: dict[str, OrderedDict[int, CommittedVersion]] = {}
        self.copies: dict[str, PinnedCopy] = {}  # name (slot@N) -> copy
        self.leases: dict[str, Lease] = {}
        #: Copies released whose LoRA is not removed yet (they still hold a pinned CPU slot).
        self.tearing_down = 0
        #: The server-private directory of the copies, made with the first one (`copy_root`).
        self.lease_dir: Path | None = None
        self._lock = asyncio.Lock()
        self._reaper: asyncio.Task | None = None
        self._teardowns: set[asyncio.Task] = set()

    # --- versions seen committed ----------------------------------------------------------
    async def observe(self) -> None:
        """Remember each slot's current (version, path, digest)."""
        for entry in await _maybe_await(self.art.slots.list()):
            slot, version, path = entry["slot"], int(entry["version"]), entry["path"]
            known = self.history.setdefault(slot, OrderedDict())
            if version in known and known[version].path == path:
                continue
            digest = entry.get("digest")
            if digest is None:
                try:
                    digest = await asyncio.to_thread(digest_dir, path)
                except OSError:
                    digest = None
            known[version] = CommittedVersion(slot, version, path, digest)
            while len(known) > HISTORY_PER_SLOT:
                known.popitem(last=False)

    # --- create ---------------------------------------------------------------------------
    def _capacity(self) -> tuple[int, int, int]:
        max_loras, max_cpu = compat.lora_capacity(self.engine_client.vllm_config)
        in_use = len(self.serving_models.lora_requests) + self.tearing_down
        return in_use, max_loras, max_cpu

    async def create(self, slot: str, version: int, ttl_s: float) -> dict[str, Any]:
        if int(getattr(self.art.args, "api_server_count", 1) or 1) > 1:
            raise LeaseError(
                409,
                "exact leases need --api-server-count 1 (a lease lives in one API server "
                "process; requests through the others would not find it)",
            )
        await self.observe()
        if slot not in self.history:
            raise LeaseError(404, f"unknown slot {slot!r}; slots: {sorted(self.history)}")
        async with self._lock:
            name = f"{slot}@{version}"
            copy = self.copies.get(name)
            if copy is None:
                copy = await self._pin(slot, version)
            now = time.time()
            lease = Lease(secrets.token_hex(8), copy, ttl_s, now, now + ttl_s)
            copy.leases.add(lease.id)
            self.leases[lease.id] = lease
            self._start_reaper()
            logger.info(
                "art lease %s: %s (lora id %d) until %.0f",
                lease.id,
                name,
                copy.lora_int_id,
                lease.expires_at,
            )
            return lease.public()

    async def _pin(self, slot: str, version: int) -> PinnedCopy:
        name = f"{slot}@{version}"
        known = self.history[slot].get(version)
        if known is None:
            current = next(reversed(self.history[slot]))
            raise LeaseError(
                404,
                f"version {version} of slot {slot!r} is not available: this server has not "
                f"committed it (versions it remembers: {sorted(self.history[slot])}, current "
                f"{slot}@{current})",
            )
        try:
            self.art.updates.paths.check_files(known.path, trusted=True)
        except PathRefused as exc:
            raise LeaseError(403, f"version {version} of slot {slot!r} is refused: {exc}") from exc
        try:
            files = await asyncio.to_thread(read_adapter_files, known.path)
        except AdapterError as exc:
            raise LeaseError(
                404, f"version {version} of slot {slot!r} is no longer available: {exc}"
            ) from exc
        digest = digest_bytes(files.config, files.weights)
        if known.digest is not None and digest != known.digest:
            raise LeaseError(
                404,
                f"version {version} of slot {slot!r} is no longer available: the adapter at "
                f"{known.path} changed since it was committed (digest {known.digest}, now "
                f"{digest})",
            )
        in_use, max_loras, max_cpu = self._capacity()
        if in_use + 1 > max_cpu:
            raise LeaseError(
                429,
                f"no LoRA capacity left for lease {name}: {in_use} adapters are loaded "
                f"(slots, LoRA modules and leases) and the server keeps at most "
                f"max_cpu_loras={max_cpu} (max_loras={max_loras}); release a lease or start "
                "the server with a larger --max-cpu-loras",
                limit=max_cpu,
                in_use=in_use,
            )
        copy_dir = self.copy_root() / f"{name}-{secrets.token_hex(4)}"
        await asyncio.to_thread(_write_copy, copy_dir, files.as_files())
        lid = compat.next_lora_int_id(self.serving_models)
        request = compat.lora_request(lora_name=name, lora_int_id=lid, lora_path=str(copy_dir))
        try:
            await self.engine_client.add_lora(request)
            # Pinned in the CPU cache only, not with `pin_lora` (which also holds a device
            # slot for good and breaks batches of `--max-loras` other adapters):
            # engine_core/lease_versions.py
            await self._on_every_engine("art_lease_keep", lid)
            await self._on_every_engine("art_lease_pin", lid, version)
        except Exception as exc:
            # Torn down as a released copy is, so that a half-made one leaks no pinned slot.
            self.tearing_down += 1
            await self._teardown(PinnedCopy(slot, version, lid, str(copy_dir), digest))
            shutil.rmtree(copy_dir, ignore_errors=True)
            raise LeaseError(
                500, f"the engine could not load lease {name}: {type(exc).__name__}: {exc}"
            ) from exc
        copy = PinnedCopy(slot, version, lid, str(copy_dir), digest)
        self.copies[name] = copy
        self.serving_models.lora_requests[name] = request  # from now on `slot@N` resolves
        return copy

    def copy_root(self) -> Path:
        """The directory of the copies: made once, private to this server (mkdtemp: 0700),
        removed at exit (each copy is removed when released)."""
        if self.lease_dir is None:
            self.lease_dir = Path(tempfile.mkdtemp(prefix=f"art-leases-{os.getpid()}-"))
            atexit.register(shutil.rmtree, self.lease_dir, True)  # copies die with the server
        return self.lease_dir

    async def _on_every_engine(self, method: str, *args) -> list[Any]:
        return [
            await compat.call_engine_utility_on(self.engine_client, identity, method, *args)
            for _, identity in compat.engine_targets(self.engine_client)
        ]

    # --- release --------------------------------------------------------------------------
    async def release(self, lease_id: str, why: str = "released") -> dict[str, Any]:
        async with self._lock:
            lease = self.leases.pop(lease_id, None)
            if lease is None:
                raise LeaseError(404, f"unknown lease {lease_id!r} (released or expired?)")
            copy = lease.copy
            copy.leases.discard(lease_id)
            last = not copy.leases
            if last:
                self.copies.pop(copy.name, None)
                self.serving_models.lora_requests.pop(copy.name, None)  # no new requests
                self.tearing_down += 1
                task = asyncio.ensure_future(self._teardown(copy))
                self._teardowns.add(task)
                task.add_done_callback(self._teardowns.discard)
        logger.info("art lease %s (%s) %s", lease_id, copy.name, why)
        return {**lease.public(), "released": why, "copy_removed": last}

    async def _teardown(self, copy: PinnedCopy) -> None:
        """Unlabel the copy's LoRA on every engine once no request uses it (they finish on
        it), then remove it, which drops its pin in the workers' CPU LoRA cache. A failure to
        unlabel does not skip the removal (see the module docstring)."""
        for _, identity in compat.engine_targets(self.engine_client):
            try:
                while True:
                    res = await compat.call_engine_utility_on(
                        self.engine_client, identity, "art_lease_unpin", copy.lora_int_id
                    )
                    if res["ok"]:
                        break
                    await asyncio.sleep(_UNPIN_POLL_S)
            except Exception:
                logger.exception(
                    "art lease copy %s: engine %r could not drop its label; removing the LoRA "
                    "anyway",
                    copy.name,
                    identity,
                )
        for attempt in range(1, _REMOVE_TRIES + 1):
            try:
                await self.engine_client.remove_lora(copy.lora_int_id)
            except Exception:
                logger.exception(
                    "art lease copy %s: removing LoRA %d failed (attempt %d of %d)",
                    copy.name,
                    copy.lora_int_id,
                    attempt,
                    _REMOVE_TRIES,
                )
                await asyncio.sleep(_REMOVE_RETRY_S)
                continue
            self.tearing_down -= 1
            shutil.rmtree(copy.path, ignore_errors=True)
            return
        logger.error(
            "art lease copy %s: LoRA %d could not be removed; it keeps its CPU cache slot and "
            "counts against capacity until the server restarts",
            copy.name,
            copy.lora_int_id,
        )

    def _start_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.ensure_future(self._reap())

    async def _reap(self) -> None:
        while self.leases:
            now = time.time()
            for lease in sorted(self.leases.values(), key=lambda x: x.expires_at):
                if lease.expires_at > now:
                    break
                with contextlib.suppress(LeaseError):
                    await self.release(lease.id, why="expired")
            soonest = min((x.expires_at for x in self.leases.values()), default=now + 1.0)
            await asyncio.sleep(min(max(soonest - time.time(), 0.01), 1.0))

    # --- reading --------------------------------------------------------------------------
    def list(self) -> list[dict[str, Any]]:
        return [x.public() for x in sorted(self.leases.values(), key=lambda x: x.created_at)]

    def by_slot(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for lease in self.list():
            out.setdefault(lease["slot"], []).append(lease)
        return out

    def alias_for(self, model: str | None) -> Alias | None:
        copy = self.copies.get(model or "")
        if copy is None:
            return None
        # `slot` is the model name the request keeps (the lease's LoRA); `check_choices` then
        # refuses a response with any token not labelled `version`.
        return Alias(copy.name, copy.version)


def _write_copy(copy_dir: Path, files: dict[str, bytes]) -> None:
    """The copy's directory (0700) and files (0600), made new: never an existing file or link."""
    copy_dir.mkdir(mode=0o700)
    os.chmod(copy_dir, 0o700)  # exactly, whatever the umask
    for name, data in files.items():
        fd = os.open(copy_dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(data)


def with_leases(manager: LeaseManager | None, slots: list[dict]) -> list[dict]:
    """`/art/v1/slots`: each slot entry gets its `leases` (none before any lease route ran)."""
    held = manager.by_slot() if manager is not None else {}
    return [{**s, "leases": held.get(s["slot"], [])} for s in slots]
