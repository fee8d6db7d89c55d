"""A real `vllm serve` on the tiny model with the plugin selected adds `/art/*`.

(That stock serve has no `/art/*` is checked on the unselected server of
`test_not_selected.py`.)"""

from __future__ import annotations

import re

import httpx
import psutil
import pytest
from support import model_runner

from art_vllm_plugin import compat, serve_process
from art_vllm_plugin.engine_core.core_pinning import CpuLayoutConfig, plan
from art_vllm_plugin.version import __version__


@pytest.fixture(scope="module")
def art_server(lora_server):
    """The shared plain plugin server (`lora` in tests/support/server_kinds.py)."""
    return lora_server


def test_capabilities_route_answers(art_server):
    resp = httpx.get(art_server.url + "/art/v1/capabilities", timeout=30)
    assert resp.status_code == 200
    body = resp.json()
    assert body["plugin"] == "art"
    assert body["plugin_version"] == __version__
    assert body["vllm_version"] == compat.vllm_version()
    assert "capabilities" in body["enabled_features"]
    assert body["features"]["capabilities"]["enabled"] is True


def test_server_runs_the_model_runner_the_suite_selected(art_server):
    """The serve suite tests the runner users get: Model Runner V2 unless the V1 subset runs
    (tests/support/model_runner.py); a server that fell back silently would fail here."""
    body = httpx.get(art_server.url + "/art/v1/capabilities", timeout=30).json()
    assert body["model_runner"] == model_runner.selected()


def test_plugin_is_active_in_api_server_engine_core_and_worker(art_server):
    api = httpx.get(art_server.url + "/art/v1/capabilities", timeout=30).json()["api_server"]
    assert api["plugin_active"] is True
    # EngineCore and worker processes log their activation once logging is configured.
    log = art_server.log_path.read_text(errors="replace")
    found = re.findall(
        r"\((EngineCore|VllmWorker-\d+) pid=(\d+)\).*art plugin active in pid (\d+)", log
    )
    roles = {role.split("-")[0] for role, _, _ in found}
    assert roles == {"EngineCore", "VllmWorker"}, art_server.log_tail()
    assert all(pid == logged for _, pid, logged in found)
    assert len(found) == 2, "each process activates exactly once"


def _cpus(proc: psutil.Process) -> set[int]:
    return {c for t in proc.threads() for c in psutil.Process(t.id).cpu_affinity()}


def test_cpu_layout_keeps_a_core_for_the_api_server_where_it_helps(art_server):
    """Default `--art-cpu-layout auto`: EngineCore shares the worker's cores exactly when
    `plan` says so for this host (on 2 cores: whenever the workers are bound to one), and
    capabilities report it."""
    api = psutil.Process(art_server.proc.pid)
    children = api.children(recursive=True)
    engine = [p for p in children if "EngineCore" in p.name()]
    workers = [p for p in children if "Worker" in p.name()]
    assert len(engine) == 1 and workers, [p.name() for p in children]
    allowed = set(api.cpu_affinity())
    worker_cpus = set().union(*(_cpus(w) for w in workers))
    expected = plan(allowed, worker_cpus, CpuLayoutConfig("auto"))
    feature = httpx.get(art_server.url + "/art/v1/capabilities", timeout=30).json()["features"]
    if expected is None:
        assert _cpus(engine[0]) == allowed
        assert feature["cpu_layout"]["enabled"] is False
    else:
        assert _cpus(engine[0]) == set(expected)
        assert feature["cpu_layout"]["enabled"] is True
        assert allowed - set(expected), "a core stays free for the API server"
    if len(allowed) == 2 and worker_cpus < allowed:
        # vLLM's default binding (the V1 lane of `make test`); unbound workers (`nobind`, the
        # other lanes: Makefile TEST_CPU) take the branch above
        assert expected is not None, "on a 2-core host with bound workers the layout applies"


def test_features_report_the_server_state(art_server):
    body = httpx.get(art_server.url + "/art/v1/capabilities", timeout=30).json()
    features = body["features"]
    assert features["inflight_lora_update"]["enabled"] is True
    assert features["prefix_cache_salting"]["enabled"] is True
    assert features["guarded_routes"] == {
        "enabled": False,
        "description": features["guarded_routes"]["description"],
        "reason": "no API key is configured (--api-key / VLLM_API_KEY): reads and generation "
        "are open, state-changing routes are open to anyone (--art-allow-unauthenticated)",
    }
    assert set(body["enabled_features"]) == {n for n, f in features.items() if f["enabled"]}


def test_stock_routes_still_serve_the_lora_slot(art_server):
    resp = httpx.post(
        art_server.url + "/v1/completions",
        json={"model": "policy", "prompt": "the policy", "max_tokens": 8, "temperature": 0},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 8


def test_plugin_selected_through_vllm_plugins_env(art_server):
    """The shared server is started without `--plugin`, with `VLLM_PLUGINS=art` set."""
    config = art_server.config
    assert config.plugin is False and config.env["VLLM_PLUGINS"] == "art"
    assert "VLLM_PLUGINS" not in config.unset_env
    assert "--plugin" not in serve_process.build_command(config, art_server.process.port)
    resp = httpx.get(art_server.url + "/art/v1/capabilities", timeout=30)
    assert resp.status_code == 200
    assert resp.json()["plugin"] == "art"
