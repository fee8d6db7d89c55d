"""Full-weight updates (`POST /art/v1/weights/update`) on two data-parallel engines (issue 26).

The server: the shared `dp2` server (tests/support/server_kinds.py): the tiny model in
float32, `--data-parallel-size 2` (two engines, two API servers), LoRA slots, the test hooks.
The new weights are the tiny model's with noise added, written by the test as a trainer's
export would be (a safetensors directory in the served model's names). What the weights
compute is checked against Hugging Face transformers on the same checkpoint, in float32
(greedy tokens of a short completion, deterministic on this host), so a partial or wrong
write shows as other tokens.

Checked:
- an update in the middle of a generation: the tokens before it are the old weights' greedy
  tokens, the spans switch to the new base version at the update's step, both engines commit
  (a receipt each) and label the new version, and requests on either engine then give the new
  weights' greedy tokens; the LoRA slot keeps serving, its spans carry the base version;
- no prefix-cache hit across base versions (vLLM's own `cached_tokens`);
- a commit that fails on engine 1 after engine 0 committed leaves both engines on the old
  weights (engine 0 reads them again), answered 500;
- a write that fails inside `load_weights`, in the middle of a layer, is undone exactly: the
  old weights' greedy tokens on both engines, the update answered 500;
- bad updates (a missing tensor, another shape, a NaN, a wrong digest, a stale version, a
  failed compare-and-swap, a path outside the roots, a `slot` field) are refused naming the
  problem, and nothing changes; an `operation_id` replays;
- an update whose restore is reported failed blocks every request (503) until a clean update.

A full-weight update changes the base weights every later module's greedy references and
spans would assume, so this module runs after every other module of that server
(`changes_base_weights`, tests/support/server_pool.py), which stops after it.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import httpx
import pytest
import torch
from support.full_weights import (
    LONG,
    PROMPT,
    ROUTE,
    SHORT,
    STEPS_BEFORE_UPDATE,
    Server,
    base_versions,
    complete,
    engine,
    export,
    generate_across_update,
    hf_greedy,
    prompt_ids,
    tokens,
    update,
)

from art_protocol.spans import validate_spans
from art_protocol.weights_digest import digest_checkpoint

pytestmark = [pytest.mark.serve, pytest.mark.changes_base_weights]


@pytest.fixture(scope="module")
def server(dp2_server, tiny_model):
    """The shared dp2 server (two engines, float32, a LoRA slot, the test hooks), as one of the
    last modules on it (`changes_base_weights`): the base weights it leaves are not the
    model's. Where a module before it moved them (test_streamed_weight_update, when run
    first), the checkpoint's own weights are published again first, as a new version: the
    tests here compare with the checkpoint's greedy tokens."""
    root = dp2_server.scratch  # inside the server's adapter root
    server = Server(dp2_server, root, tiny_model)
    if server.next_version > 1:
        resp = update(server, export(server, "checkpoint"), server.version())
        assert resp.status_code == 200, resp.text
    return server


@pytest.fixture(scope="module")
def new_weights(server) -> Path:
    return export(server, "new", noise=0.05)


@pytest.fixture(scope="module")
def refs(server, new_weights) -> dict[str, list[int]]:
    ids = prompt_ids(server)
    return {
        "old": hf_greedy(server.model, ids, LONG),
        "new": hf_greedy(new_weights, ids, SHORT),
    }


def test_an_update_mid_generation_switches_the_base_version_on_both_engines(
    server, new_weights, refs
):
    start = base_versions(server)
    assert start[0] == start[1]
    for rank in (0, 1):  # the served weights are the checkpoint's, on both engines
        assert tokens(server, rank) == refs["old"][:SHORT]
    version = server.version()
    resp, upd, s0 = generate_across_update(server, {"path": str(new_weights), "version": version})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    got = choice["token_ids"]
    spans = validate_spans(choice, LONG, latest_version=0, latest_base_version=version)
    assert [(s["slot"], s["version"], s.get("base_version", 0)) for s in spans] == [
        (None, 0, start[0]),
        (None, 0, version),
    ]
    k = spans[0]["end"]
    assert STEPS_BEFORE_UPDATE <= k < LONG, "the update must land mid-generation"
    assert k == upd["step"] - s0  # token i of a request admitted at step s0: step s0 + i
    assert got[:k] == refs["old"][:k]
    assert got[k:] != refs["old"][k:], "the new weights must change the next tokens"
    # both engines committed, with a receipt each, and label the new version
    assert upd["version"] == version and upd["previous_version"] == start[0]
    assert upd["digest"] == digest_checkpoint(new_weights).hexdigest()
    assert sorted(r["engine"] for r in upd["receipts"]) == [0, 1]
    assert base_versions(server) == [version, version]
    for rank in (0, 1):
        assert engine(server, rank)["label"].endswith(f"|b={version}")
        # a request on either engine computes with exactly the new weights
        out = complete(server, rank)["choices"][0]
        assert out["token_ids"] == refs["new"]
        assert validate_spans(out, SHORT, latest_version=0, latest_base_version=version)[0][
            "base_version"
        ] == (version)
    # the LoRA slot keeps serving, on the new base weights
    lora = complete(server, 1, model="policy")["choices"][0]
    assert [(s["slot"], s["base_version"]) for s in lora["policy_spans"]] == [("policy", version)]
    assert httpx.get(server.url + "/art/metrics", timeout=60).json()["base_version"] == version
    weights = httpx.get(server.url + "/art/v1/weights", timeout=60).json()
    assert weights["version"] == version and weights["digest"] == upd["digest"]


def test_no_prefix_cache_hit_across_base_versions(server):
    long_prompt = " ".join(["the trainer sends new weights to every engine"] * 12)

    def cached(rank: int = 0) -> int:
        out = complete(server, rank, prompt=long_prompt, max_tokens=1)
        return (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    cached()
    assert cached() > 0, "the same prompt on the same weights reuses its KV"
    v = server.version()
    resp = update(server, export(server, f"v{v}", noise=0.05, seed=v), v)
    assert resp.status_code == 200, resp.text
    assert cached() == 0, "KV computed by older base weights must not be reused"
    assert cached() > 0


def test_a_commit_failing_on_one_engine_leaves_both_on_the_old_weights(server):
    before = base_versions(server)
    old = [tokens(server, rank) for rank in (0, 1)]
    armed = httpx.post(
        server.url + "/art/v1/test/fault",
        json={"kind": "commit", "rank": 0, "engine": 1},
        timeout=60,
    )
    assert armed.status_code == 200, armed.text
    v = server.version()
    resp = update(server, export(server, f"v{v}", noise=0.05, seed=v), v)
    assert resp.status_code == 500, resp.text
    assert "engines [0] reverted" in resp.json()["error"]["message"]
    assert base_versions(server) == before
    assert [tokens(server, rank) for rank in (0, 1)] == old


def test_a_write_failing_in_the_middle_of_a_layer_is_undone_exactly(server, new_weights, refs):
    """The `commit` fault raises inside the model's `load_weights` right after one half of a
    fused layer (`worker/write_probes.py`), which leaves that layer armed with half a pass
    buffered in vLLM's layerwise reload. Writing the old weights back must first put every
    layer's tensors and reload state back: otherwise that layer is processed early from a mix
    of both passes and the rest of its old weights is dropped, while the answer says restored.
    The old weights here are `new_weights`, whose greedy tokens Hugging Face gives."""
    v = server.version()
    resp = update(server, new_weights, v)
    assert resp.status_code == 200, resp.text
    assert [tokens(server, rank) for rank in (0, 1)] == [refs["new"], refs["new"]]
    armed = httpx.post(
        server.url + "/art/v1/test/fault", json={"kind": "commit", "rank": 0}, timeout=60
    )
    assert armed.status_code == 200, armed.text
    bad = export(server, f"mid-layer-{uuid.uuid4().hex[:8]}", noise=0.05, seed=v)
    failed = update(server, bad, server.version())
    assert failed.status_code == 500, failed.text
    assert "half of a layer" in failed.json()["error"]["message"]
    assert base_versions(server) == [v, v]
    assert [tokens(server, rank) for rank in (0, 1)] == [refs["new"], refs["new"]]


def _drop(name: str):
    return lambda t: t.pop(name)


def _reshape(name: str):
    return lambda t: t.__setitem__(name, t[name][:-1])


def _nan(name: str):
    def edit(t):
        t[name] = t[name].clone()
        t[name].view(-1)[3] = float("nan")

    return edit


EMBED = "model.embed_tokens.weight"


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (_drop(EMBED), f"{EMBED}: missing from the update"),
        (_reshape(EMBED), f"{EMBED}: shape"),
        (_nan("model.norm.weight"), "model.norm.weight: holds NaN or infinite values"),
        (lambda t: t.__setitem__("extra.weight", torch.zeros(2)), "extra.weight: the served"),
    ],
)
def test_bad_weights_are_refused_naming_the_tensor(server, edit, says):
    before, old = base_versions(server), tokens(server, 0)
    v = server.next_version
    resp = update(server, export(server, f"bad-{uuid.uuid4().hex[:8]}", edit), v)
    assert resp.status_code == 422, resp.text
    message = resp.json()["error"]["message"]
    assert says in message and f"keep serving version {before[0]}" in message
    assert base_versions(server) == before and tokens(server, 0) == old


def test_refusals_of_the_request_and_replay(server, tmp_path):
    current = base_versions(server)[0]
    good = export(server, "replayed", noise=0.05, seed=99)
    cases = [
        ({"version": current}, 409, "not newer"),
        ({"version": current + 1, "expected_version": current + 5}, 409, "expected_version"),
        ({"version": current + 1, "digest": "xxh3-128:" + "0" * 32}, 422, "digest mismatch"),
    ]
    for extra, status, says in cases:
        resp = update(server, good, **extra)
        assert resp.status_code == status, resp.text
        assert says in resp.json()["error"]["message"]
    outside = tmp_path / "outside"
    shutil.copytree(good, outside)
    assert update(server, outside, current + 1).status_code == 403
    slot = httpx.post(
        server.url + ROUTE,
        json={"slot": "policy", "path": str(good), "version": current + 1},
        timeout=60,
    )
    assert slot.status_code == 400 and "'slot' must not be given" in slot.text
    assert base_versions(server) == [current, current]
    # an operation id replays its first response; reused with another body it is refused
    v = server.version()
    first = update(server, good, v, operation_id="op-1")
    assert first.status_code == 200, first.text
    again = update(server, good, v, operation_id="op-1")
    assert again.status_code == 200 and again.json()["replayed"] is True
    assert again.json()["receipts"] == first.json()["receipts"]
    other = update(server, good, v + 1, operation_id="op-1")
    assert other.status_code == 409, other.text
    assert base_versions(server) == [v, v]


def test_an_unknown_state_blocks_every_request_until_a_clean_update(server, new_weights, refs):
    armed = httpx.post(
        server.url + "/art/v1/test/fault", json={"kind": "unknown", "rank": 0}, timeout=60
    )
    assert armed.status_code == 200, armed.text
    v = server.version()
    resp = update(server, export(server, f"v{v}", noise=0.05, seed=v), v)
    assert resp.status_code == 503, resp.text
    assert "every request is refused" in resp.json()["error"]["message"]
    refused = httpx.post(
        server.url + "/v1/completions",
        json={"model": str(server.model), "prompt": PROMPT, "max_tokens": 2},
        timeout=60,
    )
    assert refused.status_code == 503, refused.text
    assert "the base weights are blocked, every request is refused" in refused.text
    v = server.version()
    clean = update(server, new_weights, v)
    assert clean.status_code == 200, clean.text
    assert tokens(server, 0) == refs["new"] and tokens(server, 1) == refs["new"]
