"""EngineCore's slot registry: admission (replay, compare-and-swap, one update per slot at a
time, different slots at once), committed state, revert, the bounded operation log, each
committed version bound to its digest, and blocked slots.

The registry is plain Python (it runs inside EngineCore); the real-server behaviour built on
it is tested in `tests/art_vllm_plugin/api_server/test_update_contract.py` and
`test_data_parallel.py`.
"""

from __future__ import annotations

from art_vllm_plugin.engine_core import slot_registry
from art_vllm_plugin.engine_core.slot_registry import SlotRegistry

D0 = "xxh3-128:" + "0" * 32
D1 = "xxh3-128:" + "1" * 32


def registry() -> SlotRegistry:
    r = SlotRegistry()
    r.register([{"name": "policy", "lora_int_id": 1, "path": "/a", "digest": D0}])
    return r


def finish_ok(r, token, version, op=None, fp=None):
    r.commit("policy", version, f"/v{version}", D1)
    r.finish(token, "policy", ok=True, operation_id=op, fingerprint=fp, response={"v": version})


def test_register_is_idempotent_and_first_registration_wins():
    r = registry()
    finish_ok(r, "t1", 1)
    r.register([{"name": "policy", "lora_int_id": 1, "path": "/other", "digest": D1}])
    snap = r.snapshot()["slots"]["policy"]
    assert (snap["version"], snap["path"], snap["digest"]) == (1, "/v1", D1)


def test_same_operation_replays_the_first_response_and_another_body_conflicts():
    r = registry()
    assert r.reserve("t1", "policy", 1, None, "op", "body-1")["ok"]
    finish_ok(r, "t1", 1, "op", "body-1")
    assert r.reserve("t2", "policy", 1, None, "op", "body-1") == {
        "ok": False,
        "kind": "replay",
        "response": {"v": 1},
    }
    res = r.reserve("t3", "policy", 2, None, "op", "body-2")
    assert res["kind"] == "conflict" and "different body" in res["error"]
    assert not r.reservations  # neither held anything


def test_expected_version_mismatch_names_both_versions():
    r = registry()
    assert r.reserve("t1", "policy", 1, 0, None, None)["ok"]
    finish_ok(r, "t1", 1)
    res = r.reserve("t2", "policy", 2, 0, None, None)
    assert res["kind"] == "conflict"
    assert "expected_version 0" in res["error"] and "current version is 1" in res["error"]


def test_one_update_per_slot_at_a_time_and_a_retry_of_it_waits():
    r = registry()
    r.register([{"name": "other", "lora_int_id": 2, "path": "/o", "digest": D0}])
    assert r.reserve("t1", "policy", 1, 0, "op", "fp")["ok"]
    busy = r.reserve("t2", "policy", 1, 0, "op2", "fp")
    assert busy["kind"] == "busy" and "slot 'policy'" in busy["error"]
    assert r.reserve("t4", "policy", 1, 0, "op", "fp")["kind"] == "busy"  # same op: wait
    finish_ok(r, "t1", 1, "op", "fp")
    assert r.reserve("t4", "policy", 1, 0, "op", "fp")["kind"] == "replay"
    # the racing client with the same expected_version loses once the winner finished
    assert r.reserve("t2", "policy", 1, 0, "op2", "fp")["kind"] == "conflict"


def test_the_holder_of_a_reservation_is_admitted_again_and_others_still_wait():
    """A streamed adapter reserves before its bytes move, then publishes them under the same
    reservation: its token is admitted again (the same operation from another token waits)."""
    r = registry()
    assert r.reserve("t1", "policy", 1, 0, "op", "fp", now=1000.0)["ok"]
    again = r.reserve("t1", "policy", 1, 0, "op", "fp", now=1001.0)
    assert again == {"ok": True, "version": 0, "server": r.server_id}
    assert r.reservations["policy"].since == 1001.0  # renewed
    assert r.reserve("t2", "policy", 1, 0, "op", "fp", now=1001.0)["kind"] == "busy"
    finish_ok(r, "t1", 1, "op", "fp")
    assert r.reserve("t1", "policy", 1, 0, "op", "fp")["kind"] == "replay"  # ended: no holder


def test_a_reservation_of_a_dead_api_server_expires():
    r = registry()
    assert r.reserve("t1", "policy", 1, None, None, None, now=1000.0)["ok"]
    later = 1000.0 + slot_registry.RESERVATION_TTL_S + 1
    assert r.reserve("t2", "policy", 1, None, None, None, now=later)["ok"]


def test_failed_update_is_counted_and_releases_its_reservation():
    r = registry()
    assert r.reserve("t1", "policy", 1, None, "op", "fp")["ok"]
    r.finish("t1", "policy", ok=False)
    assert r.slots["policy"].failed_updates == 1 and not r.reservations
    # a failed operation is not remembered: the same id may be retried
    assert r.reserve("t2", "policy", 1, None, "op", "fp")["ok"]


def test_revert_restores_the_previous_record():
    r = registry()
    previous = r.commit("policy", 3, "/v3", D1)
    r.revert(previous)
    snap = r.snapshot()["slots"]["policy"]
    assert (snap["version"], snap["path"], snap["digest"], snap["updates"]) == (0, "/a", D0, 0)


def test_operation_log_keeps_the_last_ids_per_slot():
    r = registry()
    n = slot_registry.OPERATIONS_PER_SLOT
    for v in range(1, n + 2):
        assert r.reserve(f"t{v}", "policy", v, None, f"op{v}", "fp")["ok"]
        finish_ok(r, f"t{v}", v, f"op{v}", "fp")
    ops = r.operations["policy"]
    assert len(ops) == n and "op1" not in ops and f"op{n + 1}" in ops


def test_updates_of_different_slots_are_admitted_at_the_same_time():
    r = registry()
    r.register([{"name": "other", "lora_int_id": 2, "path": "/o", "digest": D0}])
    assert r.reserve("t1", "policy", 1, None, None, None)["ok"]
    assert r.reserve("t2", "other", 1, None, None, None)["ok"]
    assert set(r.reservations) == {"policy", "other"}
    r.finish("t2", "other", ok=False)
    assert set(r.reservations) == {"policy"}  # each update ends only its own reservation
    assert r.reserve("t3", "other", 1, None, None, None)["ok"]


def test_a_dead_reservation_expires_without_touching_other_slots():
    r = registry()
    r.register([{"name": "other", "lora_int_id": 2, "path": "/o", "digest": D0}])
    assert r.reserve("t1", "policy", 1, None, None, None, now=1000.0)["ok"]
    later = 1000.0 + slot_registry.RESERVATION_TTL_S + 1
    assert r.reserve("t2", "other", 1, None, None, None, now=later - 2)["ok"]
    assert r.reserve("t3", "policy", 1, None, None, None, now=later)["ok"]
    assert r.reservations["other"].token == "t2"


def test_a_committed_version_stays_bound_to_its_digest_after_a_revert():
    """A DP revert puts the version back; the label it used keeps naming the same bytes."""
    r = registry()
    previous = r.commit("policy", 1, "/v1", D1)
    r.digests.bind("policy", 1, D1)
    r.revert(previous)
    assert r.snapshot()["slots"]["policy"]["version"] == 0
    assert r.reserve("t1", "policy", 1, None, None, None)["ok"]  # admitted: 1 is newer than 0
    why = r.digests.refusal("policy", 1, D0)
    assert why is not None and "version 1" in why and D1 in why and D0 in why
    assert r.digests.refusal("policy", 1, D1) is None  # the same bytes may be retried
    assert r.digests.refusal("policy", 2, D0) is None  # a new version may carry anything
    assert r.digests.refusal("other", 1, D0) is None  # per slot


def test_bindings_below_a_settled_version_are_dropped():
    r = registry()
    for v in (1, 2, 3):
        r.digests.bind("policy", v, D1)
    r.digests.bind("policy", 2, D0)  # the first binding stays
    assert r.digests.bound["policy"][2] == D1
    assert r.reserve("t1", "policy", 2, None, None, None)["ok"]
    r.commit("policy", 2, "/v2", D1)
    r.finish("t1", "policy", ok=True)
    assert sorted(r.digests.bound["policy"]) == [2, 3]  # 3 was committed and reverted


def test_a_blocked_slot_is_reported_and_unblocked_only_by_a_clean_update():
    r = registry()
    r.register([{"name": "other", "lora_int_id": 2, "path": "/o", "digest": D0}])
    r.block("policy", "update to version 1 failed")
    snap = r.snapshot()["slots"]
    assert snap["policy"]["blocked"] == "update to version 1 failed"
    assert snap["other"]["blocked"] is None
    assert r.blocked_lora_ids() == {1: "update to version 1 failed"}
    assert r.reserve("t1", "policy", 1, None, None, None)["ok"]  # an update is what unblocks
    r.finish("t1", "policy", ok=False)
    assert "policy" in r.blocked  # a failed update leaves it blocked
    assert r.reserve("t2", "policy", 1, None, None, None)["ok"]
    r.commit("policy", 1, "/v1", D1)
    r.finish("t2", "policy", ok=True)
    assert not r.blocked and r.snapshot()["slots"]["policy"]["blocked"] is None


def test_the_base_weights_are_admitted_replayed_and_blocked_by_the_slot_rules():
    """Full-weight updates go through the registry under `BASE` (issue 26): the same
    compare-and-swap, staleness, replay and blocking, never listed as a slot."""
    base = slot_registry.BASE
    r = registry()
    assert r.reserve("t0", base, 1, 3, None, None)["kind"] == "conflict"  # CAS on version 0
    assert r.reserve("t1", base, 1, 0, "op", "body")["ok"]
    assert r.reserve("t2", base, 2, None, None, None)["kind"] == "busy"
    assert r.reserve("t3", "policy", 1, None, None, None)["ok"]  # slots are independent
    previous = r.commit(base, 1, "/stage-1", D1)
    r.finish("t1", base, ok=True, operation_id="op", fingerprint="body", response={"v": 1})
    assert r.reserve("t4", base, 1, None, None, None)["kind"] == "stale"
    replay = r.reserve("t5", base, 1, None, "op", "body")
    assert replay["kind"] == "replay" and replay["response"] == {"v": 1}
    assert "the base weights" in r.reserve("t6", base, 2, None, "op", "other")["error"]
    snap = r.snapshot()
    assert base not in snap["slots"]
    assert (snap["base"]["version"], snap["base"]["digest"], snap["base"]["updates"]) == (1, D1, 1)
    r.revert(previous)
    assert r.snapshot()["base"]["version"] == 0 and r.base.path == ""
    r.block(base, "unknown")
    assert r.snapshot()["base"]["blocked"] == "unknown" and r.blocked_lora_ids() == {}
    assert r.reserve("t7", base, 2, None, None, None)["ok"]
    r.commit(base, 2, "/stage-2", D0)
    r.finish("t7", base, ok=True)
    assert base not in r.blocked  # a clean update unblocks


def test_admission_answers_the_servers_id_the_same_for_every_update():
    """Every API server admits on engine 0, so each learns the same id (what full-weight
    stages are tagged with); another server's registry has another one."""
    r, other = registry(), registry()
    first = r.reserve("t1", slot_registry.BASE, 1, None, None, None)
    r.release("t1")
    second = r.reserve("t2", "policy", 1, None, None, None)
    assert first["server"] == second["server"] == r.server_id
    assert other.server_id != r.server_id and len(r.server_id) == 32
