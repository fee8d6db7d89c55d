"""Installed but not selected changes nothing, on a real `vllm serve`.

Two servers with the same flags (`--disable-log-stats` included), started side by side:

- *installed*: `VLLM_PLUGINS` unset, as a user who installed art-pipeline and did not pass
  `--plugin art` has it (vLLM then loads every installed plugin of every group);
- *baseline*: the art plugin's entry points disabled: `VLLM_PLUGINS` names every installed
  vLLM plugin except `art` (vLLM's own switch, `vllm/plugins/__init__.py`).

They must expose the same `/metrics` families and routes, honour `--disable-log-stats` alike,
and log the same warnings; the *installed* one is stock serve: no `/art/*` route at all.
(Before, the stat-logger entry point made vLLM force `log_stats` on, and the endpoint entry
point made it warn "Found endpoint plugin(s) ['art'] ...".)
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import entry_points

import httpx
import pytest
from support.vllm_server import LORA_ARGS

from art_vllm_plugin import serve_process

GROUPS = (
    "vllm.general_plugins",
    "vllm.platform_plugins",
    "vllm.io_processor_plugins",
    "vllm.stat_logger_plugins",
    "vllm.endpoint_plugins",
)


def _other_plugins() -> str:
    names = {ep.name for group in GROUPS for ep in entry_points(group=group)} - {"art"}
    return ",".join(sorted(names))


def _normalize(line: str) -> str:
    line = re.sub(r"^\(\w+(?:-\d+)? pid=\d+\)\s*", "", line)
    line = re.sub(r"\d{2}-\d{2} \d{2}:\d{2}:\d{2}", "T", line)
    return re.sub(r"\d+", "N", line)


def _observe(tiny_model, tiny_adapters, log_path, env) -> dict:
    config = serve_process.ServeConfig(
        model=str(tiny_model),
        args=(*LORA_ARGS, "--lora-modules", f"policy={tiny_adapters / 'a'}", "--disable-log-stats"),
        plugin=False,
        env=env,
        unset_env=("VLLM_PLUGINS", "ART_VLLM_CPU_LAYOUT"),
        log_path=log_path,
    )
    with serve_process.serving(config) as server:
        resp = httpx.post(
            server.url + "/v1/completions",
            json={"model": "policy", "prompt": "the policy", "max_tokens": 8},
            timeout=120,
        )
        assert resp.status_code == 200, resp.text
        assert "policy_spans" not in resp.json()["choices"][0]
        metrics = httpx.get(server.url + "/metrics", timeout=60).text
        routes = set(httpx.get(server.url + "/openapi.json", timeout=60).json()["paths"])
        log = server.log_path.read_text(errors="replace").splitlines()
        # after reading the log: the access log line of this probe names /art/
        capabilities = httpx.get(server.url + "/art/v1/capabilities", timeout=30).status_code
    return {
        "capabilities_status": capabilities,
        "log": log,
        "families": set(re.findall(r"^# TYPE (\S+) ", metrics, re.M)),
        "routes": routes,
        "warnings": sorted(
            {_normalize(line) for line in log if re.search(r"\b(WARNING|ERROR)\b", line)}
        ),
        "log_stats": sorted({_normalize(line) for line in log if "log_stats" in line}),
        "art": [line for line in log if "art plugin" in line or "/art/" in line],
    }


@pytest.fixture(scope="module")
def observed(tiny_model, tiny_adapters, tmp_path_factory):
    """Two servers of their own (what they load at start is the subject: a shared server always
    has the plugin selected), started at the same time: each mostly waits on its own start."""
    logs = tmp_path_factory.mktemp("not-selected")
    with ThreadPoolExecutor(2) as pool:
        installed = pool.submit(_observe, tiny_model, tiny_adapters, logs / "installed.log", {})
        baseline = pool.submit(
            _observe,
            tiny_model,
            tiny_adapters,
            logs / "baseline.log",
            {"VLLM_PLUGINS": _other_plugins()},
        )
        return installed.result(), baseline.result()


def test_same_metrics_families(observed):
    installed, baseline = observed
    assert installed["families"] == baseline["families"]


def test_disable_log_stats_is_honoured_alike(observed):
    installed, baseline = observed
    assert installed["log_stats"] == baseline["log_stats"]


def test_same_warnings(observed):
    installed, baseline = observed
    assert installed["warnings"] == baseline["warnings"]


def test_same_routes_and_no_trace_of_the_plugin(observed):
    installed, baseline = observed
    assert installed["routes"] == baseline["routes"]
    assert installed["art"] == [] and baseline["art"] == []


def test_stock_serve_without_plugin_has_no_art_routes(observed):
    installed, _ = observed
    assert installed["capabilities_status"] == 404
    assert not any(p.startswith("/art") for p in installed["routes"])
    assert "/v1/completions" in installed["routes"]
    assert not any("art plugin active" in line for line in installed["log"])
