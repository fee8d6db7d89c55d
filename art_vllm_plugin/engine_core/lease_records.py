"""Utility calls on engine 0 that keep the exact leases of every API server (`lease_book`).

An API server making a lease (`api_server/leases.py`) asks engine 0 for the committed version
(`art_lease_version`, from the registry's history: any API server may have committed it), for
the copy already serving `slot@N` or a LoRA id for a new one (`art_lease_begin`), then records
the lease (`art_lease_add`). Releasing through any API server is `art_lease_release`. Every
change moves the registry's generation, so the other API servers read the new book with their
next registry read (`api_server/state.py`, `registry_slots`).
"""

from __future__ import annotations

from art_vllm_plugin.engine_core.state import engine_state


def art_lease_version(self, slot: str, version: int) -> dict:
    """Path and digest of committed `version` of `slot`, or what is remembered instead."""
    registry = engine_state(self).registry
    if slot not in registry.slots:
        return {"ok": False, "kind": "unknown", "slots": sorted(registry.slots)}
    found = registry.committed(slot, int(version))
    if found is None:
        return {
            "ok": False,
            "kind": "version",
            "remembered": registry.remembered(slot),
            "current": registry.version(slot),
        }
    return {"ok": True, "path": found[0], "digest": found[1]}


def art_lease_begin(self, name: str) -> dict:
    return engine_state(self).registry.leases.begin(name)


def art_lease_add(self, made: dict | None, lease: dict) -> dict:
    registry = engine_state(self).registry
    res = registry.leases.add(made, lease)
    if res["ok"]:
        registry.generation += 1
    return res


def art_lease_release(self, lease_id: str) -> dict | None:
    registry = engine_state(self).registry
    res = registry.leases.release(lease_id)
    if res is not None:
        registry.generation += 1
    return res
