"""Full-weight updates of an MoE model whose experts span two data-parallel engines (issue 36,
item 5): every engine commits inside one pause of the whole group (`api_server/expert_cut.py`).

The server, its own (the layout is the subject, and each update pauses both engines, which
other modules' timing tests would feel): the tiny Qwen3-MoE over `--data-parallel-size 2`,
float32, eager, one API server (the test hooks and the window live in the API server that
updates). Its experts are tensor-parallel over both engines' ranks (vLLM's layout without
`--enable-expert-parallel`): every token of either engine passes through a shard of every
expert on both, in lock step. `--enable-expert-parallel` itself cannot run on this CPU (vLLM
0.32's CPU MoE kernel has no expert map: the first forward crashes), and the plugin treats both
layouts alike (`expert_layout.experts_across_engines`). vLLM's CPU communicator lacks the
variable-size collectives both layouts need; a test-only plugin gives it them
(`tests/support/ep_cpu`).

Checked (Hugging Face transformers in float32 is the reference of every token):
- an update with the commit call to engine 1 held back 1.5 s (test hook `lag`) commits on both
  engines inside a window it opened itself (`GET /art/v1/weights` `commit_window`: opened,
  not inside a client's pause, lasting the lag), resumes them, and both serve the new
  weights' greedy tokens;
- a commit that fails on engine 1 after engine 0 committed: 500 naming the revert, and both
  engines serve the old weights' greedy tokens (engine 0's experts restored exactly);
- an update while a client paused generation (`POST /pause?mode=keep`): it commits inside
  that pause and leaves the engines paused until the client resumes;
- on CPU the MoE layers of an update get the experts' prepack vLLM skips on updates
  (`worker/cpu_moe_updates.py`): every check above compares with Hugging Face's tokens.

Not here: an update sent while a generation runs. On this CPU host such an update was admitted
only once the generation ended in most runs (engine utility calls stalled during the DP
lockstep generation; open, see docs/scale-out.md). Where it landed mid-generation, the tokens
before and after the switch were Hugging Face's (over the old weights' KV cache), and with the
window disabled a token after the switch came from mixed experts.
"""

from __future__ import annotations

import os

import httpx
import pytest
from support.full_weights import (
    Server,
    base_versions,
    complete,
    export,
    hf_greedy,
    prompt_ids,
    update,
)
from support.server_kinds import OPEN, _dp_binding
from support.vllm_server import TINY

from art_vllm_plugin import serve_process

pytestmark = pytest.mark.serve

#: The test-only plugin with the CPU communicator's variable-size collectives.
EP_CPU_SHIM = os.path.join(os.path.dirname(__file__), "..", "support", "ep_cpu")
#: How late the commit call to engine 1 is sent (test hook `lag`).
LAG_S = 1.5


@pytest.fixture(scope="module")
def server(tmp_path_factory, server_log):
    model = TINY / "moe"
    if not (model / "config.json").exists():
        pytest.fail(f"the tiny MoE model is missing at {model}: run `make tiny`")
    root = tmp_path_factory.mktemp("experts-across-engines")
    inherited = os.environ.get("PYTHONPATH", "")
    env = {
        "ART_TEST_HOOKS": "1",
        "VLLM_SERVER_DEV_MODE": "1",  # /pause, /resume, /is_paused
        "PYTHONPATH": os.pathsep.join(p for p in (os.path.abspath(EP_CPU_SHIM), inherited) if p),
        "VLLM_PLUGINS": "art,art_ep_cpu",
        **_dp_binding(),
    }
    config = serve_process.ServeConfig(
        model=str(model),
        args=(
            *("--data-parallel-size", "2", "--dtype", "float32", "--enforce-eager"),
            # One API server (vLLM starts one per DP engine by default): the lag hook and the
            # commit window's hold on client pauses live in the API server that updates.
            *("--api-server-count", "1"),
            *("--max-model-len", "512", "--gpu-memory-utilization", "0.2"),
            *("--art-adapter-root", str(root)),
            *OPEN,
        ),
        env=env,
        plugin=False,  # VLLM_PLUGINS names art and the test plugin
        unset_env=(),
        log_path=server_log,
        startup_timeout_s=900,
    )
    proc = serve_process.start(config)
    try:
        yield Server(proc, root, model)
    finally:
        proc.stop()


def fault(server, **body) -> None:
    armed = httpx.post(server.url + "/art/v1/test/fault", json=body, timeout=60)
    assert armed.status_code == 200, armed.text


def test_an_update_pauses_every_engine_for_its_commits_and_resumes_them(server):
    """Engine 1's commit call is sent 1.5 s after engine 0's, inside the window the update
    opened itself (the engines were not paused): both engines then serve Hugging Face's
    tokens of the new weights, and the window lasted the lag."""
    ids = prompt_ids(server)
    version = server.version()
    new = export(server, f"v{version}", noise=0.05, seed=version)
    fault(server, kind="lag", seconds=LAG_S, engine=1)
    resp = update(server, new, version)
    assert resp.status_code == 200, resp.text
    assert sorted(x["engine"] for x in resp.json()["receipts"]) == [0, 1]
    assert base_versions(server) == [version, version]
    reference = hf_greedy(new, ids, 12)
    for engine in (0, 1):
        assert complete(server, engine)["choices"][0]["token_ids"] == reference
    window = httpx.get(server.url + "/art/v1/weights", timeout=60).json()["commit_window"]
    assert window["required"] and "mixture-of-experts" in window["why"]
    assert window["opened"] == 1 and window["inside_client_pause"] == 0
    assert window["last_window_ms"] >= LAG_S * 1e3
    paused = httpx.get(server.url + "/is_paused", timeout=60)
    assert paused.status_code == 200 and paused.json()["is_paused"] is False


def test_a_commit_failing_on_one_engine_is_reverted_inside_the_window(server):
    before = base_versions(server)
    old = server.root / "trainer" / f"v{before[0]}"
    ids = prompt_ids(server)
    version = server.version()
    bad = export(server, f"v{version}", noise=0.05, seed=version)
    fault(server, kind="commit", rank=0, engine=1)
    resp = update(server, bad, version)
    assert resp.status_code == 500, resp.text
    assert "engines [0] reverted" in resp.json()["error"]["message"]
    assert base_versions(server) == before
    reference = hf_greedy(old, ids, 12)
    for engine in (0, 1):  # engine 0's revert restored exactly the old experts
        assert complete(server, engine)["choices"][0]["token_ids"] == reference
    window = httpx.get(server.url + "/art/v1/weights", timeout=60).json()["commit_window"]
    assert window["opened"] == 2


def test_an_update_inside_a_clients_pause_leaves_the_engines_paused(server):
    ids = prompt_ids(server)
    version = server.version()
    new = export(server, f"v{version}", noise=0.05, seed=version)
    paused = httpx.post(server.url + "/pause", params={"mode": "keep"}, timeout=120)
    assert paused.status_code == 200, paused.text
    try:
        resp = update(server, new, version)
        assert resp.status_code == 200, resp.text
        still = httpx.get(server.url + "/is_paused", timeout=60)
        assert still.status_code == 200 and still.json()["is_paused"] is True
        weights = httpx.get(server.url + "/art/v1/weights", timeout=60).json()
        assert weights["commit_window"]["inside_client_pause"] == 1
    finally:
        resumed = httpx.post(server.url + "/resume", timeout=120)
        assert resumed.status_code == 200, resumed.text
    assert base_versions(server) == [version, version]
    reference = hf_greedy(new, ids, 12)
    for engine in (0, 1):
        assert complete(server, engine)["choices"][0]["token_ids"] == reference
