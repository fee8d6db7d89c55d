"""`--lora-modules NAME=HUB_ID` on a plugin-selected server: it starts, serves the module, and
refuses that module for in-flight updates with a clear message.

vLLM itself resolves a hub id in the worker (`lora/utils.py` `get_adapter_absolute_path`):
with `HF_HUB_OFFLINE=1` and no cached snapshot, stock vLLM refuses to start, so the test hands
it a snapshot in a local hub cache, exactly as a user with a pre-downloaded adapter has. The
server also runs with `--art-cpu-layout off`: EngineCore keeps vLLM's own layout. The server
is the shared `two_slots` kind (test_lease_capacity uses it too; tests/support/server_kinds.py).
"""

from __future__ import annotations

import httpx
import psutil
import pytest
from support.server_kinds import HUB_ID, TWO_SLOTS

from art_protocol.client import ArtClient, ArtError


@pytest.fixture(scope="module")
def server(two_slots_server):
    """The shared `two_slots` server (tests/support/server_kinds.py): its `--lora-modules` has
    `hub=HUB_ID`, resolved at start from a local hub cache (`HF_HUB_CACHE`), beside the local
    slots, and it runs `--art-cpu-layout off`."""
    return two_slots_server


def test_server_starts_and_serves_the_hub_module(server):
    resp = httpx.post(
        server.url + "/v1/completions",
        json={"model": "hub", "prompt": "the policy", "max_tokens": 8, "temperature": 0},
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["policy_spans"] == [
        {"start": 0, "end": 8, "slot": "hub", "version": 0}
    ]


def test_hub_module_is_refused_for_updates_with_a_clear_message(server, tiny_adapters):
    with ArtClient(server.url) as art:
        assert sorted(s["slot"] for s in art.slots()) == sorted(TWO_SLOTS)  # the local ones
        with pytest.raises(ArtError) as err:
            art.update("hub", tiny_adapters / "c", 1)
        assert err.value.status == 400
        assert f"started from '{HUB_ID}', which is not a local adapter directory" in (
            err.value.message
        )
        assert "nothing changed" in err.value.message
        feature = art.capabilities()["features"]["inflight_lora_update"]
        assert feature["enabled"] is True
        assert "hub" in feature["refused_slots"]
        # The local slot keeps working.
        version = server.start_versions["policy"] + 1
        assert art.update("policy", tiny_adapters / "c", version)["version"] == version


def test_cpu_layout_off_leaves_engine_core_where_vllm_put_it(server):
    api = psutil.Process(server.proc.pid)
    engine = [p for p in api.children(recursive=True) if "EngineCore" in p.name()]
    assert len(engine) == 1, [p.name() for p in api.children(recursive=True)]
    cpus = {c for t in engine[0].threads() for c in psutil.Process(t.id).cpu_affinity()}
    assert cpus == set(api.cpu_affinity())
    with ArtClient(server.url) as art:
        assert art.capabilities()["features"]["cpu_layout"]["enabled"] is False
