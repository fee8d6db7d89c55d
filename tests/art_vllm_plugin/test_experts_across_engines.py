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

The workers of both engines share the host's second core, and the first stays for the API
server and the test (`_dp_binding_leaving_a_core`): with one worker bound to each of the two
cores, the lock-step generation kept both busy and the unbound processes got no CPU until it
ended, so an update sent mid-generation was admitted after it.

Checked (Hugging Face transformers in float32 is the reference of every token):
- an update in the middle of a generation on engine 0, with the commit call to engine 1
  held back 1.5 s (test hook `lag`): the tokens before the switch are the old weights'
  greedy tokens and every token after it is Hugging Face's greedy continuation on the new
  weights over the old weights' keys and values (`hf_greedy_across_update`: what an
  in-flight switch computes), so no forward ran on experts of two versions though engine 0
  committed 1.5 s before engine 1 (with each engine committing at its own next step, dozens
  of tokens would run on mixed experts); the update opened its own window, lasting the lag,
  and resumed the engines; both then serve the new weights' tokens;
- a commit that fails on engine 1 after engine 0 committed, mid-generation: 500 naming the
  revert, every token of the generation running across it is the old weights' (engine 0's
  new experts never computed a token), and both engines serve the old weights' tokens after
  it (engine 0's experts restored exactly);
- an update while a client paused generation (`POST /pause?mode=keep`): it commits inside
  that pause and leaves the engines paused until the client resumes;
- on CPU the MoE layers of an update get the experts' prepack vLLM skips on updates
  (`worker/cpu_moe_updates.py`): every check above compares with Hugging Face's tokens.
"""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
from support.full_weights import (
    PROMPT,
    Server,
    base_versions,
    complete,
    export,
    hf_greedy,
    hf_greedy_across_update,
    prompt_ids,
    update,
)
from support.server_kinds import OPEN, _dp_binding_leaving_a_core
from support.streamed_ride import Ride, ride_a_stream
from support.vllm_server import TINY

from art_protocol.spans import validate_spans
from art_vllm_plugin import serve_process

pytestmark = pytest.mark.serve

#: The test-only plugin with the CPU communicator's variable-size collectives.
EP_CPU_SHIM = os.path.join(os.path.dirname(__file__), "..", "support", "ep_cpu")
#: How late the commit call to engine 1 is sent (test hook `lag`).
LAG_S = 1.5
#: Tokens of the ridden generation before the update is sent, and after the switch that must
#: follow the new weights (with the 1.5 s lag, mixed forwards would have made many).
TOKENS_BEFORE = 6
TOKENS_AFTER = 12
#: The ridden generation runs on engine 0; engine 1 steps with it in lock step.
PIN = {"X-data-parallel-rank": "0"}


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
        **_dp_binding_leaving_a_core(),
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


def ride(server, body: dict, settled) -> Ride:
    """A greedy generation on engine 0 that the update `body` rides (`support/streamed_ride`)."""
    generation = {
        "model": str(server.model),
        "prompt": PROMPT,
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
    }

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
            return await ride_a_stream(
                client,
                generation,
                body,
                tokens_before=TOKENS_BEFORE,
                settled=settled,
                update_route="/art/v1/weights/update",
                headers=PIN,
            )

    return asyncio.run(run())


def base_spans(r: Ride) -> list[tuple[int, int, int]]:
    return [(s["start"], s["end"], s.get("base_version", 0)) for s in r.spans]


def window_figures(server) -> dict:
    return httpx.get(server.url + "/art/v1/weights", timeout=60).json()["commit_window"]


def test_an_update_mid_generation_switches_every_engine_at_one_step(server):
    """Engine 1's commit call is sent 1.5 s after engine 0's: inside the window no engine
    steps, so the switch is one step for both."""
    start = base_versions(server)
    ids = prompt_ids(server)
    version = server.version()
    new = export(server, f"v{version}", noise=0.05, seed=version)
    fault(server, kind="lag", seconds=LAG_S, engine=1)

    def settled(r: Ride) -> bool:
        return sum(e - s for s, e, v in base_spans(r) if v == version) >= TOKENS_AFTER

    r = ride(server, {"path": str(new), "version": version}, settled)
    assert r.update.status_code == 200, r.update.text
    assert sorted(x["engine"] for x in r.update.json()["receipts"]) == [0, 1]
    spans = validate_spans(r.choice, len(r.tokens), latest_version=0, latest_base_version=version)
    assert [s.get("base_version", 0) for s in spans] == [start[0], version]
    k = spans[0]["end"]
    assert k >= TOKENS_BEFORE
    assert r.tokens[:k] == hf_greedy(server.model, ids, k)
    after = r.tokens[k:]
    assert after == hf_greedy_across_update(server.model, new, ids, r.tokens[:k], len(after)), (
        "a token after the switch is not the new weights' greedy token: it ran on mixed experts"
    )
    assert base_versions(server) == [version, version]
    reference = hf_greedy(new, ids, 12)
    for engine in (0, 1):
        assert complete(server, engine)["choices"][0]["token_ids"] == reference
    window = window_figures(server)
    assert window["required"] and "mixture-of-experts" in window["why"]
    assert window["opened"] == 1 and window["inside_client_pause"] == 0
    assert window["last_window_ms"] >= LAG_S * 1e3
    paused = httpx.get(server.url + "/is_paused", timeout=60)
    assert paused.status_code == 200 and paused.json()["is_paused"] is False


def test_a_commit_failing_on_one_engine_is_reverted_before_any_engine_steps(server):
    before = base_versions(server)
    old_dir = server.root / "trainer" / f"v{before[0]}"
    old = old_dir if old_dir.exists() else server.model
    ids = prompt_ids(server)
    version = server.version()
    bad = export(server, f"v{version}", noise=0.05, seed=version)
    fault(server, kind="commit", rank=0, engine=1)

    def settled(r: Ride) -> bool:
        return len(r.tokens) >= TOKENS_BEFORE + TOKENS_AFTER

    r = ride(server, {"path": str(bad), "version": version}, settled)
    assert r.update.status_code == 500, r.update.text
    assert "engines [0] reverted" in r.update.json()["error"]["message"]
    assert {s.get("base_version", 0) for s in r.spans} == {before[0]}
    assert r.tokens == hf_greedy(old, ids, len(r.tokens)), (
        "a token of the generation is not the old weights': engine 0's new experts computed it"
    )
    assert base_versions(server) == before
    reference = hf_greedy(old, ids, 12)
    for engine in (0, 1):  # engine 0's revert restored exactly the old experts
        assert complete(server, engine)["choices"][0]["token_ids"] == reference
    assert window_figures(server)["opened"] == 2


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
