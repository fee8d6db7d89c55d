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

Where leases live: in engine 0's slot registry (`engine_core/lease_book.py`), like the slots,
so with several API servers (`--api-server-count`, one per DP engine by default) a lease made
through one resolves, lists and releases through every other: each API server reads the book
with the registry (at engine 0's pushed generation, a fresh read before it refuses an alias,
`api_server/alias_requests.py`) and installs a copy made elsewhere in its own model list on
first use. The committed versions a lease can copy are the registry's history (the last 64 of
each slot, whichever API server committed them). LoRA ids of copies come from the book, so two
API servers never reuse one. A request naming `slot@N` through another API server while the
lease is being released there may still reach the copy until that server reads the registry
again; the copy is unlabelled only once no request uses it.
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
from pathlib import Path
from typing import Any

from art_protocol.digest import digest_bytes
from art_vllm_plugin import compat
from art_vllm_plugin.adapters import AdapterError, read_adapter_files
from art_vllm_plugin.api_server.aliases import Alias
from art_vllm_plugin.api_server.paths import PathRefused

logger = logging.getLogger("vllm.art_plugin.leases")

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
    """One API server's side of the exact leases; the leases themselves are kept in engine
    0's registry (`engine_core/lease_book.py`), shared by every API server."""

    def __init__(self, art_state: Any, serving_models: Any):
        self.art = art_state
        self.engine_client = art_state.engine_client
        self.serving_models = serving_models
        #: Lease copies this API server resolves (their names are in its `lora_requests`).
        self.installed: set[str] = set()
        #: Copies released here whose LoRA is not removed yet (they still hold a CPU slot).
        self.tearing_down = 0
        #: The server-private directory of the copies, made with the first one (`copy_root`).
        self.lease_dir: Path | None = None
        self._lock = asyncio.Lock()
        self._reaper: asyncio.Task | None = None
        self._teardowns: set[asyncio.Task] = set()

    async def _engine0(self, method: str, *args) -> Any:
        engine0 = self.art.slots.engines[0].identity
        return await compat.call_engine_utility_on(self.engine_client, engine0, method, *args)

    async def book(self) -> dict:
        """Every API server's leases as engine 0 has them now (one registry read)."""
        await self.art.slots.refresh(force=True)
        return self.art.slots.lease_book

    # --- create ---------------------------------------------------------------------------
    def _capacity(self, book: dict) -> tuple[int, int, int]:
        """(adapters resident: the slots and LoRA modules, every API server's lease copies,
        copies still being torn down here; max_loras; max_cpu_loras)."""
        max_loras, max_cpu = compat.lora_capacity(self.engine_client.vllm_config)
        own = [n for n in self.serving_models.lora_requests if n not in self.installed]
        in_use = len(own) + len(book["copies"]) + self.tearing_down
        return in_use, max_loras, max_cpu

    async def create(self, slot: str, version: int, ttl_s: float) -> dict[str, Any]:
        name = f"{slot}@{version}"
        async with self._lock:
            for _ in range(3):  # another API server may pin or release the copy meanwhile
                begun = await self._engine0("art_lease_begin", name)
                found, made = begun["copy"], None
                if found is None:
                    made = await self._pin(slot, version, begun["lora_int_id"])
                now = time.time()
                lease = {
                    "id": secrets.token_hex(8),
                    "name": name,
                    "ttl_s": ttl_s,
                    "created_at": now,
                    "expires_at": now + ttl_s,
                }
                added = await self._engine0("art_lease_add", made, lease)
                if added["ok"]:
                    break
                if made is not None:  # another API server's copy was recorded first
                    self.tearing_down += 1
                    await self._teardown(made)
            else:
                raise LeaseError(503, f"lease {name}: the copy kept changing; try again")
            copy = added["copy"]
            await self.art.slots.refresh(force=True)
            self._install(copy)
            self._start_reaper()
            logger.info(
                "art lease %s: %s (lora id %d) until %.0f",
                lease["id"],
                name,
                copy["lora_int_id"],
                lease["expires_at"],
            )
            return public(lease, copy)

    async def _version(self, slot: str, version: int) -> tuple[str, str]:
        """Path and digest of committed `version` of `slot` (through any API server)."""
        found = await self._engine0("art_lease_version", slot, version)
        if found["ok"]:
            return found["path"], found["digest"]
        if found["kind"] == "unknown":
            raise LeaseError(404, f"unknown slot {slot!r}; slots: {found['slots']}")
        raise LeaseError(
            404,
            f"version {version} of slot {slot!r} is not available: the server has not "
            f"committed it (versions it remembers: {found['remembered']}, current "
            f"{slot}@{found['current']})",
        )

    async def _pin(self, slot: str, version: int, lid: int) -> dict:
        """Copy committed `version` of `slot` and load it as LoRA `lid` on every engine."""
        name = f"{slot}@{version}"
        path, recorded = await self._version(slot, version)
        try:
            self.art.updates.paths.check_files(path, trusted=True)
        except PathRefused as exc:
            raise LeaseError(403, f"version {version} of slot {slot!r} is refused: {exc}") from exc
        try:
            files = await asyncio.to_thread(read_adapter_files, path)
        except AdapterError as exc:
            raise LeaseError(
                404, f"version {version} of slot {slot!r} is no longer available: {exc}"
            ) from exc
        digest = digest_bytes(files.config, files.weights)
        if recorded and digest != recorded:
            raise LeaseError(
                404,
                f"version {version} of slot {slot!r} is no longer available: the adapter at "
                f"{path} changed since it was committed (digest {recorded}, now {digest})",
            )
        in_use, max_loras, max_cpu = self._capacity(await self.book())
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
        copy = {
            "name": name,
            "slot": slot,
            "version": version,
            "lora_int_id": lid,
            "path": str(copy_dir),
            "digest": digest,
        }
        try:
            await self.engine_client.add_lora(_request(copy))
            # Pinned in the CPU cache only, not with `pin_lora` (which also holds a device
            # slot for good and breaks batches of `--max-loras` other adapters):
            # engine_core/lease_versions.py
            await self._on_every_engine("art_lease_keep", lid)
            await self._on_every_engine("art_lease_pin", lid, version)
        except Exception as exc:
            # Torn down as a released copy is, so that a half-made one leaks no pinned slot.
            self.tearing_down += 1
            await self._teardown(copy)
            shutil.rmtree(copy_dir, ignore_errors=True)
            raise LeaseError(
                500, f"the engine could not load lease {name}: {type(exc).__name__}: {exc}"
            ) from exc
        return copy

    def _install(self, copy: dict) -> None:
        """From now on `slot@N` resolves here to the copy's LoRA."""
        self.serving_models.lora_requests[copy["name"]] = _request(copy)
        self.installed.add(copy["name"])

    def _uninstall(self, name: str) -> None:
        if name in self.installed:
            self.installed.discard(name)
            self.serving_models.lora_requests.pop(name, None)  # no new requests

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
            released = await self._engine0("art_lease_release", lease_id)
            if released is None:
                raise LeaseError(404, f"unknown lease {lease_id!r} (released or expired?)")
            lease, last = released["lease"], released["last_copy"]
            copy = last or self.art.slots.lease_book["copies"].get(lease["name"], {})
            if last is not None:
                self._uninstall(last["name"])
                self.tearing_down += 1
                task = asyncio.ensure_future(self._teardown(last))
                self._teardowns.add(task)
                task.add_done_callback(self._teardowns.discard)
            await self.art.slots.refresh(force=True)
        logger.info("art lease %s (%s) %s", lease_id, lease["name"], why)
        return {**public(lease, copy), "released": why, "copy_removed": last is not None}

    async def _teardown(self, copy: dict) -> None:
        """Unlabel the copy's LoRA on every engine once no request uses it (they finish on
        it), then remove it, which drops its pin in the workers' CPU LoRA cache. A failure to
        unlabel does not skip the removal (see the module docstring)."""
        name, lid = copy["name"], copy["lora_int_id"]
        for _, identity in compat.engine_targets(self.engine_client):
            try:
                while True:
                    res = await compat.call_engine_utility_on(
                        self.engine_client, identity, "art_lease_unpin", lid
                    )
                    if res["ok"]:
                        break
                    await asyncio.sleep(_UNPIN_POLL_S)
            except Exception:
                logger.exception(
                    "art lease copy %s: engine %r could not drop its label; removing the LoRA "
                    "anyway",
                    name,
                    identity,
                )
        for attempt in range(1, _REMOVE_TRIES + 1):
            try:
                await self.engine_client.remove_lora(lid)
            except Exception:
                logger.exception(
                    "art lease copy %s: removing LoRA %d failed (attempt %d of %d)",
                    name,
                    lid,
                    attempt,
                    _REMOVE_TRIES,
                )
                await asyncio.sleep(_REMOVE_RETRY_S)
                continue
            self.tearing_down -= 1
            shutil.rmtree(copy["path"], ignore_errors=True)
            return
        logger.error(
            "art lease copy %s: LoRA %d could not be removed; it keeps its CPU cache slot and "
            "counts against capacity until the server restarts",
            name,
            lid,
        )

    def _start_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.ensure_future(self._reap())

    async def _reap(self) -> None:
        """Release expired leases, whichever API server made them, while any is left (every
        API server that made a lease runs this; a lease is released once: engine 0 says who
        tears its copy down)."""
        while leases := list((await self.book())["leases"].values()):
            now = time.time()
            for lease in sorted(leases, key=lambda x: x["expires_at"]):
                if lease["expires_at"] > now:
                    break
                with contextlib.suppress(LeaseError):
                    await self.release(lease["id"], why="expired")
            soonest = min(x["expires_at"] for x in leases)
            await asyncio.sleep(min(max(soonest - time.time(), 0.01), 1.0))

    # --- reading --------------------------------------------------------------------------
    def list(self) -> list[dict[str, Any]]:
        """The leases as this API server last read them (`book()` reads them anew)."""
        return leases_of(self.art.slots.lease_book)

    def alias_for(self, model: str | None) -> Alias | None:
        """The lease copy `model` names, per the registry copy this API server last read; a
        copy made through another API server is installed here on first use, one released
        elsewhere is dropped here."""
        copy = self.art.slots.lease_book["copies"].get(model or "")
        if copy is None:
            if model in self.installed:
                self._uninstall(model)
            return None
        if model not in self.installed:
            self._install(copy)
        # `slot` is the model name the request keeps (the lease's LoRA); `check_choices` then
        # refuses a response with any token not labelled `version`.
        return Alias(copy["name"], copy["version"])


def _request(copy: dict):
    return compat.lora_request(
        lora_name=copy["name"], lora_int_id=copy["lora_int_id"], lora_path=copy["path"]
    )


def public(lease: dict, copy: dict) -> dict[str, Any]:
    """A lease as the routes answer it."""
    return {
        "id": lease["id"],
        "slot": copy.get("slot"),
        "version": copy.get("version"),
        "model": lease["name"],
        "lora_int_id": copy.get("lora_int_id"),
        "digest": copy.get("digest"),
        "ttl_s": lease["ttl_s"],
        "created_at": lease["created_at"],
        "expires_at": lease["expires_at"],
    }


def leases_of(book: dict) -> list[dict[str, Any]]:
    copies = book["copies"]
    leases = sorted(book["leases"].values(), key=lambda x: x["created_at"])
    return [public(x, copies.get(x["name"], {})) for x in leases]


def _write_copy(copy_dir: Path, files: dict[str, bytes]) -> None:
    """The copy's directory (0700) and files (0600), made new: never an existing file or link."""
    copy_dir.mkdir(mode=0o700)
    os.chmod(copy_dir, 0o700)  # exactly, whatever the umask
    for name, data in files.items():
        fd = os.open(copy_dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(data)


def with_leases(book: dict, slots: list[dict]) -> list[dict]:
    """`/art/v1/slots`: each slot entry gets its `leases`, every API server's."""
    held: dict[str, list[dict]] = {}
    for lease in leases_of(book):
        held.setdefault(lease["slot"], []).append(lease)
    return [{**s, "leases": held.get(s["slot"], [])} for s in slots]
