"""The API server's state: one object per app, reached by patched serving methods through the
`OpenAIServingModels` every serving object shares. Each test builds a fresh one (no module
globals to reset), the way the endpoint plugin builds one per API-server process."""

from __future__ import annotations

from argparse import Namespace
from types import SimpleNamespace

import pytest

from art_vllm_plugin.api_server.aliases import Alias, AliasRefused
from art_vllm_plugin.api_server.state import ApiServerState, api_server_state


def _state(**slot_versions: int) -> ApiServerState:
    view = SimpleNamespace(
        slots={name: SimpleNamespace(version=v) for name, v in slot_versions.items()},
        lease_book={"copies": {}, "leases": {}},  # engine 0's, as the last registry read had it
    )
    return ApiServerState(
        engine_client=None,
        args=Namespace(),
        started_at=0.0,
        serving_models=SimpleNamespace(lora_requests={}),
        slots=view,
        updates=None,
        base_updates=None,
        adapter_streams=None,
        api_key_digests=[],
    )


def test_serving_objects_of_the_app_reach_its_state():
    state = _state(policy=3)
    app_state = SimpleNamespace()
    state.attach(app_state)
    assert app_state.art is state
    completion = SimpleNamespace(models=state.serving_models)
    chat = SimpleNamespace(models=state.serving_models)
    assert api_server_state(completion) is state and api_server_state(chat) is state


def test_a_serving_object_of_another_app_has_no_state():
    first, second = _state(policy=1), _state(policy=1)
    first.attach(SimpleNamespace())
    assert api_server_state(SimpleNamespace(models=second.serving_models)) is None
    assert api_server_state(SimpleNamespace()) is None


def test_an_alias_resolves_against_this_servers_slots():
    state = _state(policy=3)
    assert state.resolve_alias("policy@3") == Alias("policy", 3)
    assert state.resolve_alias("policy") is None
    assert state.resolve_alias("other@3") is None
    with pytest.raises(AliasRefused, match="no longer served; current is policy@3"):
        state.resolve_alias("policy@2")


def test_a_leased_version_resolves_before_the_slot():
    state = _state(policy=5)
    state._leases = SimpleNamespace(
        alias_for=lambda model: Alias("policy@2", 2) if model == "policy@2" else None
    )
    assert state.resolve_alias("policy@2") == Alias("policy@2", 2)
    assert state.resolve_alias("policy@5") == Alias("policy", 5)
