"""Lease ids in EngineCore labels: a pinned lease's id decodes to its fixed version."""

from __future__ import annotations

from types import SimpleNamespace

from art_protocol.provenance import encode_versions, slot_version
from art_vllm_plugin.engine_core import lease_versions


def _core(label: str) -> SimpleNamespace:
    return SimpleNamespace(_weight_version=label)


def test_no_lease_leaves_every_label_unchanged():
    core = _core("default")
    for label in ("default", encode_versions({1: 3}), None):
        assert lease_versions.extend(core, label) == label
    assert lease_versions.current_if_pinned(core) is None


def test_a_pinned_lease_adds_its_version_and_keeps_the_slots():
    core = _core(encode_versions({1: 9}))
    lease_versions.art_lease_pin(core, 5, 4)
    label = lease_versions.extend(core, encode_versions({1: 9}))
    assert slot_version(label, 5) == 4 and slot_version(label, 1) == 9
    # vLLM's initial label means "every slot at 0": the lease still says its version.
    assert slot_version(lease_versions.extend(core, "default"), 5) == 4
    assert slot_version(lease_versions.current_if_pinned(core), 1) == 9


def test_unpin_waits_for_requests_that_use_the_id():
    req = SimpleNamespace(lora_request=SimpleNamespace(lora_int_id=5))
    core = _core("default")
    core.scheduler = SimpleNamespace(requests={"r": req})
    lease_versions.art_lease_pin(core, 5, 4)
    assert lease_versions.art_lease_unpin(core, 5) == {"ok": False, "busy": 1}
    assert lease_versions.pinned(core) == {5: 4}
    core.scheduler.requests.clear()
    assert lease_versions.art_lease_unpin(core, 5) == {"ok": True}
    assert lease_versions.extend(core, "default") == "default"
