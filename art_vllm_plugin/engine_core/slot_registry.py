"""The slot registry kept in EngineCore: the one source of truth every API server reads.

Why in EngineCore: vLLM may run several API-server processes (`--api-server-count`, and by
default one per DP engine). A registry in each of them disagrees as soon as an update goes
through one: the others report stale versions and validate `slot@N` aliases against them.
EngineCore outlives and is shared by all of them, so each engine holds one registry (slot
versions, committed paths, digests, update counters, the recent `operation_id`s) and every
API server reads it with a utility call. With data parallelism every engine holds an
identical copy: an update commits on every engine or on none (`api_server/slot_publish.py`).

Engine 0's registry also serialises the updates of one slot across API servers: an update
first *reserves* its slot there (`reserve`), which is where `operation_id` replay and
`expected_version` compare-and-swap are decided atomically (utility calls run one at a time
between engine steps). Updates of different slots hold different reservations and run at the
same time. A reservation left by an API server that died is taken over after
`RESERVATION_TTL_S`.

Every engine's registry also keeps two rules that outlive a failed update:
- each version it ever committed stays bound to its digest (`version_digests`), so a label
  never names two sets of weights;
- a slot whose update failed with its state unknown (some worker could not restore its
  weights) is *blocked* until a later update of it commits cleanly everywhere
  (`finish(ok=True)`): requests on it are refused (`engine_core/blocked_slots.py`).

Engine 0's registry also names the server: `server_id`, a random id made when the engine
starts, answered with every admitted update. Every API server of one `vllm serve` reads the
same one, and no other server has it, so full-weight stages are tagged with it and each
server removes only its own (`staging.remove_superseded_base`).

Plain Python, no vLLM: it is unit-tested directly and used by `engine_core/slot_updates.py`.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections import OrderedDict
from dataclasses import asdict, dataclass, field

from art_protocol.weight_updates import BASE_SLOT, slot_named
from art_vllm_plugin.engine_core.lease_book import LeaseBook
from art_vllm_plugin.engine_core.version_digests import VersionDigests

#: `operation_id`s remembered per slot (the oldest is forgotten first).
OPERATIONS_PER_SLOT = 512
#: Committed versions remembered per slot for leases (the oldest is forgotten first).
HISTORY_PER_SLOT = 64
#: A reservation older than this belongs to an API server that died mid-update.
RESERVATION_TTL_S = 900.0
#: The registry's key for the base weights: full-weight updates are admitted, replayed,
#: compare-and-swapped, bound to digests and blocked by the same rules as a slot's. Not a
#: valid slot name (vLLM's LoRA names are served model names), never listed as a slot.
BASE = BASE_SLOT
#: The LoRA id a base update takes in the engine's update books (LoRA ids start at 1).
BASE_ID = 0


@dataclass
class SlotRecord:
    name: str
    lora_int_id: int
    version: int
    path: str
    digest: str
    updated_at: float
    updates: int = 0
    failed_updates: int = 0
    last_update_ms: float | None = None


@dataclass
class Reservation:
    token: str
    slot: str
    operation_id: str | None
    fingerprint: str | None
    since: float


@dataclass
class SlotRegistry:
    slots: dict[str, SlotRecord] = field(default_factory=dict)
    #: slot -> operation_id -> (fingerprint, first successful response)
    operations: dict[str, OrderedDict] = field(default_factory=dict)
    #: slot -> the update of that slot in progress (engine 0 only; one per slot)
    reservations: dict[str, Reservation] = field(default_factory=dict)
    #: slot -> why it is blocked (the update that left its state unknown)
    blocked: dict[str, str] = field(default_factory=dict)
    #: each committed version's digest, per slot
    digests: VersionDigests = field(default_factory=VersionDigests)
    #: slot -> version -> (path, digest) of its last `HISTORY_PER_SLOT` committed versions:
    #: what a lease of an older version copies (`api_server/leases.py`)
    history: dict[str, OrderedDict] = field(default_factory=dict)
    #: the exact leases of every API server (engine 0's book is the one used)
    leases: LeaseBook = field(default_factory=LeaseBook)
    #: the base weights' record: version, path of the files of that version ("" for the
    #: served model's own), digest
    base: SlotRecord = field(default_factory=lambda: SlotRecord(BASE, BASE_ID, 0, "", "", 0.0))
    #: bumped on every change a reader could see
    generation: int = 0
    #: this server's id (engine 0's is the one used): what its full-weight stages are tagged
    #: with, shared by its API servers and by no other server
    server_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        self.operations.setdefault(BASE, OrderedDict())

    def record(self, slot: str) -> SlotRecord | None:
        """The record of `slot`, or of the base weights for `BASE`."""
        return self.base if slot == BASE else self.slots.get(slot)

    def register(self, slots: list[dict]) -> None:
        """Add the slots an API server started with; slots already known are kept as they are
        (every API server registers the same `--lora-modules`, the first one wins)."""
        now = time.time()
        for s in slots:
            if s["name"] not in self.slots:
                self.slots[s["name"]] = SlotRecord(
                    name=s["name"],
                    lora_int_id=int(s["lora_int_id"]),
                    version=0,
                    path=s["path"],
                    digest=s["digest"],
                    updated_at=now,
                )
                self.operations[s["name"]] = OrderedDict()
                self._remember(s["name"], 0, s["path"], s["digest"])
                self.generation += 1

    def snapshot(self) -> dict:
        return {
            "generation": self.generation,
            "slots": {
                name: {**asdict(rec), "blocked": self.blocked.get(name)}
                for name, rec in self.slots.items()
            },
            "leases": self.leases.snapshot(),
            "base": {**asdict(self.base), "blocked": self.blocked.get(BASE)},
        }

    def _remember(self, slot: str, version: int, path: str, digest: str) -> None:
        known = self.history.setdefault(slot, OrderedDict())
        known[version] = (path, digest)
        while len(known) > HISTORY_PER_SLOT:
            known.popitem(last=False)

    def committed(self, slot: str, version: int) -> tuple[str, str] | None:
        """(path, digest) of `version` of `slot` if it was committed and is remembered."""
        return self.history.get(slot, {}).get(version)

    def remembered(self, slot: str) -> list[int]:
        return sorted(self.history.get(slot, {}))

    def version(self, slot: str) -> int:
        rec = self.slots.get(slot)
        return rec.version if rec is not None else 0

    def versions_by_id(self) -> dict[int, int]:
        return {r.lora_int_id: r.version for r in self.slots.values() if r.version}

    # --- engine 0: admission of an update -------------------------------------------------
    def reserve(
        self,
        token: str,
        slot: str,
        version: int,
        expected_version: int | None,
        operation_id: str | None,
        fingerprint: str | None,
        now: float | None = None,
    ) -> dict:
        """Admit an update of `slot` or say why not: `busy` (another update of the slot is in
        progress: retry shortly), `replay` (this operation already succeeded: its response),
        `conflict` (operation id reused with another body, or expected_version mismatch),
        `stale` (version not newer), `unknown` slot. Updates of other slots do not matter:
        one update per slot at a time, any number of slots at once. The holder of the slot's
        reservation (`token`) is admitted again: a streamed adapter reserves before its bytes
        move and publishes them under the same reservation (`api_server/adapter_stream.py`)."""
        now = time.time() if now is None else now
        rec = self.record(slot)
        if rec is None:
            return {"ok": False, "kind": "unknown", "error": f"unknown slot {slot!r}"}
        held = self.reservations.get(slot)
        if held is not None and now - held.since > RESERVATION_TTL_S:
            del self.reservations[slot]
            held = None
        if held is not None and held.token == token:
            held.since = now
            return {"ok": True, "version": rec.version, "server": self.server_id}
        if operation_id is not None:
            seen = self.operations[slot].get(operation_id)
            if seen is not None:
                first_fp, response = seen
                if first_fp != fingerprint:
                    return _conflict_reused(operation_id, slot)
                return {"ok": False, "kind": "replay", "response": copy.deepcopy(response)}
            if held is not None and held.slot == slot and held.operation_id == operation_id:
                if held.fingerprint != fingerprint:
                    return _conflict_reused(operation_id, slot)
                return {
                    "ok": False,
                    "kind": "busy",
                    "error": "the same operation is in progress",
                    "held_s": now - held.since,
                }
        if held is not None:
            return {
                "ok": False,
                "kind": "busy",
                "error": f"another update of {slot_named(slot)} is in progress",
                # since it was admitted or last renewed (a full-weight stage that progresses)
                "held_s": now - held.since,
            }
        if expected_version is not None and expected_version != rec.version:
            return {
                "ok": False,
                "kind": "conflict",
                "error": f"expected_version {expected_version} for {slot_named(slot)} but the "
                f"current version is {rec.version}",
                "version": rec.version,
            }
        if version <= rec.version:
            return {
                "ok": False,
                "kind": "stale",
                "error": f"version {version} for {slot_named(slot)} is not newer than the current "
                f"version {rec.version}",
                "version": rec.version,
            }
        self.reservations[slot] = Reservation(token, slot, operation_id, fingerprint, now)
        return {"ok": True, "version": rec.version, "server": self.server_id}

    def renew(self, token: str, now: float | None = None) -> bool:
        """The update `token` is alive (its stage progresses): its reservation counts its
        `RESERVATION_TTL_S` from `now`. False when it holds none here (not engine 0)."""
        now = time.time() if now is None else now
        for held in self.reservations.values():
            if held.token == token:
                held.since = now
                return True
        return False

    def release(self, token: str) -> None:
        for slot, held in list(self.reservations.items()):
            if held.token == token:
                del self.reservations[slot]

    # --- every engine: the committed state -------------------------------------------------
    def commit(self, slot: str, version: int, path: str, digest: str) -> SlotRecord:
        """Record a committed version; returns the previous record (for a revert)."""
        rec = self.record(slot)
        previous = copy.copy(rec)
        rec.version, rec.path, rec.digest = version, path, digest
        rec.updated_at = time.time()
        rec.updates += 1
        self._remember(slot, version, path, digest)
        self.generation += 1
        return previous

    def revert(self, previous: SlotRecord) -> None:
        """Put back the record a commit replaced; the version's digest binding stays."""
        reverted = self.record(previous.name)
        if reverted is not None and reverted.version != previous.version:
            self.history.get(previous.name, {}).pop(reverted.version, None)  # never served
        if previous.name == BASE:
            self.base = previous
        else:
            self.slots[previous.name] = previous
        self.generation += 1

    def block(self, slot: str, reason: str) -> None:
        """`slot`'s weights are unknown after a failed update: refuse its requests."""
        self.blocked[slot] = reason
        self.generation += 1

    def blocked_lora_ids(self) -> dict[int, str]:
        """LoRA id -> why, for every blocked slot."""
        return {
            self.slots[name].lora_int_id: why
            for name, why in self.blocked.items()
            if name in self.slots
        }

    def finish(
        self,
        token: str,
        slot: str,
        *,
        ok: bool,
        operation_id: str | None = None,
        fingerprint: str | None = None,
        response: dict | None = None,
        elapsed_ms: float | None = None,
    ) -> None:
        """End of an update on this engine: remember a successful operation, count a failed
        one, drop the reservation. A success committed on every engine: the slot is no longer
        blocked and its version is settled (`VersionDigests.settle`)."""
        rec = self.record(slot)
        if rec is not None:
            if ok:
                rec.last_update_ms = elapsed_ms
                self.blocked.pop(slot, None)
                self.digests.settle(slot, rec.version)
                if operation_id is not None:
                    ops = self.operations[slot]
                    ops[operation_id] = (fingerprint, copy.deepcopy(response))
                    while len(ops) > OPERATIONS_PER_SLOT:
                        ops.popitem(last=False)
            else:
                rec.failed_updates += 1
            self.generation += 1
        self.release(token)


def _conflict_reused(operation_id: str, slot: str) -> dict:
    return {
        "ok": False,
        "kind": "conflict",
        "error": f"operation_id {operation_id!r} was already used for {slot_named(slot)} with a "
        "different body (slot, path, version, expected_version, digest)",
    }
