"""Lease ids in EngineCore labels: a pinned lease's id decodes to its fixed version.

Each test builds a fresh `EngineCoreState` and attaches it to a stand-in engine, the way the
plugin attaches one to each real EngineCore, so nothing is shared between tests.
"""

from __future__ import annotations

from types import SimpleNamespace

from art_protocol.provenance import encode_versions, slot_version
from art_vllm_plugin import compat
from art_vllm_plugin.engine_core import lease_versions
from art_vllm_plugin.engine_core.state import EngineCoreState, LeaseLabels, engine_state


def _core(label: str, **attrs) -> SimpleNamespace:
    core = SimpleNamespace(_weight_version=label, **attrs)
    compat.attach_state(core, EngineCoreState())
    return core


def test_no_lease_leaves_every_label_unchanged():
    leases = LeaseLabels()
    for label in ("default", encode_versions({1: 3}), None):
        assert leases.extend(label) == label
    assert leases.current_if_pinned("default") is None


def test_a_pinned_lease_adds_its_version_and_keeps_the_slots():
    core = _core(encode_versions({1: 9}))
    lease_versions.art_lease_pin(core, 5, 4)
    leases = engine_state(core).leases
    label = leases.extend(encode_versions({1: 9}))
    assert slot_version(label, 5) == 4 and slot_version(label, 1) == 9
    # vLLM's initial label means "every slot at 0": the lease still says its version.
    assert slot_version(leases.extend("default"), 5) == 4
    assert slot_version(leases.current_if_pinned(compat.engine_weight_label(core)), 1) == 9


def test_unpin_waits_for_requests_that_use_the_id():
    req = SimpleNamespace(lora_request=SimpleNamespace(lora_int_id=5))
    core = _core("default", scheduler=SimpleNamespace(requests={"r": req}))
    lease_versions.art_lease_pin(core, 5, 4)
    assert lease_versions.art_lease_unpin(core, 5) == {"ok": False, "busy": 1}
    assert engine_state(core).leases.pinned == {5: 4}
    core.scheduler.requests.clear()
    assert lease_versions.art_lease_unpin(core, 5) == {"ok": True}
    assert engine_state(core).leases.extend("default") == "default"


def test_each_engine_has_its_own_leases():
    """Two engines in one process (DP, or tests) share nothing."""
    first, second = _core("default"), _core("default")
    lease_versions.art_lease_pin(first, 5, 4)
    assert engine_state(second).leases.pinned == {}
