"""Stock `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` on a real server: a slot name is
refused with 409 naming `/art/v1/lora/update`, and nothing about the slot changes; any other
LoRA name loads and unloads as in stock vLLM.

The shared plain plugin server (`lora` in tests/support/server_kinds.py, which turns vLLM's
runtime LoRA routes on with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`): slot `policy` is handed
over on adapter a; adapter b's greedy tokens differ from a's.
"""

from __future__ import annotations

import httpx
import pytest

PROMPT = "the policy model learns from the reward and the trainer sends"


@pytest.fixture(scope="module")
def server(lora_server):
    """The shared plain plugin server (`lora` in tests/support/server_kinds.py)."""
    return lora_server


def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=300)


def _tokens(server, model: str) -> list[int]:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    resp = _post(server, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


def _policy(server) -> dict:
    slots = httpx.get(server.url + "/art/v1/slots", timeout=60).json()
    return {s["slot"]: s for s in slots}["policy"]


@pytest.mark.parametrize(
    ("route", "extra"),
    [
        ("/v1/load_lora_adapter", {}),
        ("/v1/load_lora_adapter", {"load_inplace": True}),
        ("/v1/unload_lora_adapter", None),
    ],
    ids=["load", "load_inplace", "unload"],
)
def test_a_slot_name_is_refused_and_the_slot_is_untouched(server, tiny_adapters, route, extra):
    before, tokens = _policy(server), _tokens(server, "policy")
    body = {"lora_name": "policy"}
    if extra is not None:  # a load: adapter b would change the tokens if it were taken
        body.update(lora_path=str(tiny_adapters / "b"), **extra)
    resp = _post(server, route, body)
    assert resp.status_code == 409, resp.text
    message = resp.json()["error"]["message"]
    assert "'policy' is an art slot" in message and "/art/v1/lora/update" in message
    after = _policy(server)
    assert (after["version"], after["digest"]) == (before["version"], before["digest"])
    assert _tokens(server, "policy") == tokens


def test_another_name_loads_and_unloads_as_in_stock_vllm(server, tiny_adapters):
    load = {"lora_name": "stock_extra", "lora_path": str(tiny_adapters / "b")}
    resp = _post(server, "/v1/load_lora_adapter", load)
    assert resp.status_code == 200, resp.text
    assert _tokens(server, "stock_extra") == _tokens(server, "ref_b")
    resp = _post(server, "/v1/unload_lora_adapter", {"lora_name": "stock_extra"})
    assert resp.status_code == 200, resp.text
    assert (
        _post(server, "/v1/completions", {"model": "stock_extra", "prompt": "x"}).status_code == 404
    )
