"""Every API server's exact leases, kept in engine 0's registry (`lease_book`,
`lease_records`): what lets a lease made through one API server serve, list and release
through another. Plain registry objects and a stand-in engine; served for real with two API
servers in test_data_parallel.py."""

from __future__ import annotations

import pytest
from support.stand_in_engine import stand_in_engine

from art_vllm_plugin.engine_core import lease_records
from art_vllm_plugin.engine_core.lease_book import LORA_ID_BASE, LeaseBook
from art_vllm_plugin.engine_core.slot_registry import HISTORY_PER_SLOT, SlotRegistry
from art_vllm_plugin.engine_core.state import engine_state

pytestmark = pytest.mark.serve


def copy_of(name: str, lid: int) -> dict:
    slot, version = name.split("@")
    return {"name": name, "slot": slot, "version": int(version), "lora_int_id": lid,
            "path": f"/copies/{name}", "digest": "xxh3-128:d"}  # fmt: skip


def lease(lease_id: str, name: str) -> dict:
    return {"id": lease_id, "name": name, "ttl_s": 60.0, "created_at": 1.0, "expires_at": 61.0}


def test_a_second_lease_of_a_version_shares_its_copy_and_the_last_release_frees_it():
    book = LeaseBook()
    begun = book.begin("policy@3")
    assert begun == {"copy": None, "lora_int_id": LORA_ID_BASE}
    assert book.add(copy_of("policy@3", LORA_ID_BASE), lease("l1", "policy@3"))["ok"]
    again = book.begin("policy@3")  # another API server: the copy is found, no new id
    assert again["copy"]["lora_int_id"] == LORA_ID_BASE
    assert book.add(None, lease("l2", "policy@3"))["ok"]
    assert book.release("l1")["last_copy"] is None  # l2 still holds it
    assert book.release("l2")["last_copy"]["lora_int_id"] == LORA_ID_BASE
    assert book.release("l2") is None and book.snapshot() == {"copies": {}, "leases": {}}


def test_two_api_servers_pinning_one_version_at_once_keep_the_first_copy():
    book = LeaseBook()
    first, second = book.begin("policy@3"), book.begin("policy@3")
    assert first["lora_int_id"] != second["lora_int_id"]  # ids are never handed out twice
    assert book.add(copy_of("policy@3", first["lora_int_id"]), lease("a", "policy@3"))["ok"]
    lost = book.add(copy_of("policy@3", second["lora_int_id"]), lease("b", "policy@3"))
    assert not lost["ok"] and lost["copy"]["lora_int_id"] == first["lora_int_id"]
    assert set(book.leases) == {"a"}  # the loser drops its copy and adds to this one


def test_a_lease_on_a_copy_released_meanwhile_is_refused():
    book = LeaseBook()
    assert book.add(None, lease("a", "policy@3")) == {"ok": False, "copy": None}


def test_the_registry_remembers_committed_versions_for_leases_and_forgets_reverted_ones():
    reg = SlotRegistry()
    reg.register([{"name": "policy", "lora_int_id": 1, "path": "/start", "digest": "d0"}])
    assert reg.committed("policy", 0) == ("/start", "d0")
    previous = reg.commit("policy", 1, "/v1", "d1")
    reg.commit("policy", 2, "/v2", "d2")
    assert reg.committed("policy", 1) == ("/v1", "d1") and reg.remembered("policy") == [0, 1, 2]
    reg.slots["policy"].version = 3
    reg.revert(previous)  # a commit undone because another engine failed: never served
    assert 3 not in reg.remembered("policy")
    for v in range(4, 4 + HISTORY_PER_SLOT):
        reg.commit("policy", v, f"/v{v}", f"d{v}")
    assert len(reg.remembered("policy")) == HISTORY_PER_SLOT
    assert reg.committed("policy", 0) is None  # the oldest went first


def test_lease_changes_move_the_registry_generation_and_ride_in_its_snapshot():
    core, _ = stand_in_engine(has_requests=False)
    registry = engine_state(core).registry
    registry.register([{"name": "policy", "lora_int_id": 1, "path": "/start", "digest": "d0"}])
    assert lease_records.art_lease_version(core, "policy", 0) == {
        "ok": True, "path": "/start", "digest": "d0",
    }  # fmt: skip
    missing = lease_records.art_lease_version(core, "policy", 7)
    assert missing["kind"] == "version" and missing["remembered"] == [0]
    assert lease_records.art_lease_version(core, "nope", 0)["kind"] == "unknown"
    generation = registry.generation
    lid = lease_records.art_lease_begin(core, "policy@0")["lora_int_id"]
    assert lease_records.art_lease_add(core, copy_of("policy@0", lid), lease("l", "policy@0"))["ok"]
    assert registry.generation == generation + 1
    assert set(registry.snapshot()["leases"]["leases"]) == {"l"}
    assert lease_records.art_lease_release(core, "l")["last_copy"]["lora_int_id"] == lid
    assert registry.generation == generation + 2
    assert lease_records.art_lease_release(core, "l") is None
    assert registry.generation == generation + 2
