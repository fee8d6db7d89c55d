"""`/art/v1/capabilities` reports each feature's real state: on a plugin-selected server
without `--enable-lora` (the shared `moe_routes` server of tests/support/server_kinds.py), the
LoRA features are off and say why."""

from __future__ import annotations

import httpx
import pytest

LORA_FEATURES = ("inflight_lora_update", "exact_aliases", "exact_leases", "prefix_cache_salting")


@pytest.fixture(scope="module")
def server(moe_routes_server):
    """A plugin-selected server started without `--enable-lora`."""
    assert "--enable-lora" not in moe_routes_server.config.args
    return moe_routes_server


def test_lora_features_are_off_without_enable_lora(server):
    body = httpx.get(server.url + "/art/v1/capabilities", timeout=60).json()
    for name in LORA_FEATURES:
        feature = body["features"][name]
        assert feature["enabled"] is False, (name, feature)
        assert "--enable-lora" in feature["reason"]
        assert name not in body["enabled_features"]
    assert body["features"]["policy_spans"]["enabled"] is True
    assert body["features"]["guarded_routes"]["enabled"] is False  # no API key configured
    assert "no API key" in body["features"]["guarded_routes"]["reason"]


def test_base_model_choices_still_carry_spans(server):
    resp = httpx.post(
        server.url + "/v1/completions",
        json={"model": server.config.model, "prompt": "the policy", "max_tokens": 6},
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["policy_spans"] == [
        {"start": 0, "end": 6, "slot": None, "version": 0}
    ]
