"""The exact leases of every API server, kept in engine 0's slot registry.

Why there: vLLM may run several API-server processes, and a lease made through one must be
found through the others (a request on `slot@N` reaches whichever API server the kernel picks)
and released through any. The registry already is the one place every API server reads, at a
generation each of them caches (`slot_registry.py`); the book lives in it and rides in its
snapshot, so a change to a lease moves the generation like a committed update does.

What is here is bookkeeping only: which copies of a slot version are pinned (their LoRA id and
private directory), which leases hold them, and the LoRA ids handed out to copies. Loading a
copy, labelling its tokens and tearing it down stay with the API server that does it
(`api_server/leases.py`) and the engines (`engine_core/lease_versions.py`).

LoRA ids of copies are handed out here, from `LORA_ID_BASE` up, so two API servers never give
two copies one id (each API server's own counter, vLLM's `lora_id_counter`, numbers only the
adapters it loads itself).

Plain Python, no vLLM: unit-tested directly.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

#: First LoRA id of a lease copy: far above the ids vLLM gives `--lora-modules` and runtime
#: loads (it counts from 1 in each API server).
LORA_ID_BASE = 1 << 24


@dataclass
class LeaseBook:
    #: model name (`slot@N`) -> {"name", "slot", "version", "lora_int_id", "path", "digest"}
    copies: dict[str, dict] = field(default_factory=dict)
    #: lease id -> {"id", "name", "ttl_s", "created_at", "expires_at"}
    leases: dict[str, dict] = field(default_factory=dict)
    next_lora_int_id: int = LORA_ID_BASE

    def begin(self, name: str) -> dict:
        """The copy serving `name` if there is one, else a fresh LoRA id for a new copy."""
        held = self.copies.get(name)
        if held is not None:
            return {"copy": copy.deepcopy(held), "lora_int_id": held["lora_int_id"]}
        lid = self.next_lora_int_id
        self.next_lora_int_id += 1
        return {"copy": None, "lora_int_id": lid}

    def add(self, made: dict | None, lease: dict) -> dict:
        """Record `lease` on the copy of its name. `made`: the copy the caller just pinned for
        it (None: it found one with `begin`). Refused (`ok` False) when another copy of the
        name was recorded first (two API servers pinned it at once: the caller drops its own
        and takes the returned one), or when the copy it found was released since."""
        name = lease["name"]
        held = self.copies.get(name)
        if made is not None and held is not None and held["lora_int_id"] != made["lora_int_id"]:
            return {"ok": False, "copy": copy.deepcopy(held)}
        if made is None and held is None:
            return {"ok": False, "copy": None}
        if held is None:
            self.copies[name] = copy.deepcopy(made)
        self.leases[lease["id"]] = copy.deepcopy(lease)
        return {"ok": True, "copy": copy.deepcopy(self.copies[name])}

    def release(self, lease_id: str) -> dict | None:
        """Drop lease `lease_id`: {"lease", "last_copy"} where `last_copy` is the copy it was
        the last lease of (the caller tears it down), else None; None for an unknown id."""
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return None
        name = lease["name"]
        last = None
        if not any(x["name"] == name for x in self.leases.values()):
            last = self.copies.pop(name, None)
        return {"lease": lease, "last_copy": last}

    def snapshot(self) -> dict:
        return {"copies": copy.deepcopy(self.copies), "leases": copy.deepcopy(self.leases)}
