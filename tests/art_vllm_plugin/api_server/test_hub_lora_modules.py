"""`--lora-modules NAME=HUB_ID` on a plugin-selected server: it starts, serves the module, and
refuses that module for in-flight updates with a clear message.

vLLM itself resolves a hub id in the worker (`lora/utils.py` `get_adapter_absolute_path`):
with `HF_HUB_OFFLINE=1` and no cached snapshot, stock vLLM refuses to start, so the test hands
it a snapshot in a local hub cache, exactly as a user with a pre-downloaded adapter has. The
server also runs with `--art-cpu-layout off`: EngineCore keeps vLLM's own layout.
"""

from __future__ import annotations

import shutil

import httpx
import psutil
import pytest
from support.vllm_server import LORA_ARGS

from art_protocol.client import ArtClient, ArtError
from art_vllm_plugin import serve_process

HUB_ID = "fakeorg/tiny-lora-b"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_adapters):
    """A local Hugging Face hub cache holding HUB_ID at COMMIT (adapter b's files)."""
    cache = tmp_path_factory.mktemp("hf") / "hub"
    repo = cache / f"models--{HUB_ID.replace('/', '--')}"
    shutil.copytree(tiny_adapters / "b", repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


@pytest.fixture(scope="module")
def server(tiny_model, tiny_adapters, hub_cache, server_log):
    """A server of its own: resolving a hub-id `--lora-modules` entry at start-up (from
    `HF_HUB_CACHE`) and `--art-cpu-layout off` are the subject; no shared kind runs them."""
    config = serve_process.ServeConfig(
        model=str(tiny_model),
        args=(
            *LORA_ARGS,
            *serve_process.ALLOW_UNAUTHENTICATED,  # the update refusal is the 400, not a 403
            "--lora-modules",
            f"policy={tiny_adapters / 'a'}",
            f"hub={HUB_ID}",
            "--art-cpu-layout",
            "off",
        ),
        env={"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"},
        log_path=server_log,
    )
    with serve_process.serving(config) as srv:
        yield srv


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
        assert [s["slot"] for s in art.slots()] == ["policy"]
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
        assert art.update("policy", tiny_adapters / "c", 1)["version"] == 1


def test_cpu_layout_off_leaves_engine_core_where_vllm_put_it(server):
    api = psutil.Process(server.proc.pid)
    engine = [p for p in api.children(recursive=True) if "EngineCore" in p.name()]
    assert len(engine) == 1, [p.name() for p in api.children(recursive=True)]
    cpus = {c for t in engine[0].threads() for c in psutil.Process(t.id).cpu_affinity()}
    assert cpus == set(api.cpu_affinity())
    with ArtClient(server.url) as art:
        assert art.capabilities()["features"]["cpu_layout"]["enabled"] is False
