"""Exact leases (`POST/GET/DELETE /art/v1/leases`), on a real `vllm serve`.

A fresh server started with adapter b as its LoRA module gives the reference greedy tokens
(then stops). The module's server starts slot `policy` on adapter a; version 1 (b) is leased;
then five updates of the slot land *in the middle of* evaluation requests on `policy@1` (the
engine is frozen with vLLM's dev-mode `POST /pause?mode=keep` while the update is published,
as in test_inflight_update.py), and every evaluation must return exactly the reference tokens
with every span at version 1. Then the refusals (401, 400, 404, 429) and the releases
(DELETE, expiry) on the same server. Tests run in file order.
"""

from __future__ import annotations

import asyncio
import shutil
import time

import httpx
import pytest

from art_protocol.digest import digest_dir
from art_vllm_plugin import serve_process

KEY = "lease-key"
PROMPTS = [
    "the policy model learns from the reward and the trainer sends",
    "exact evaluation of one version while the slot keeps moving",
]
LONG = 120
STEPS_BEFORE_UPDATE = 6
#: (version, tiny adapter) published to slot `policy` after version 0 (= a); v1 is leased.
PLAN = [(1, "b"), (2, "c"), (3, "a"), (4, "c"), (5, "a"), (6, "c")]
AUTH = {"Authorization": f"Bearer {KEY}"}


def _body(model: str, prompt: str) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": LONG,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_adapters):
    """Adapter directories, one per version (as a trainer writes them)."""
    base = tmp_path_factory.mktemp("lease_adapters")
    shutil.copytree(tiny_adapters / "a", base / "v0")
    for version, name in PLAN:
        shutil.copytree(tiny_adapters / name, base / f"v{version}")
    for version, name in ((7, "b"), (8, "a")):
        shutil.copytree(tiny_adapters / name, base / f"v{version}")
    return base


@pytest.fixture(scope="module")
def reference(tiny_model, tiny_adapters, server_log):
    """Greedy tokens of a fresh server whose LoRA module is adapter b (stopped afterwards)."""
    config = serve_process.ServeConfig(
        model=str(tiny_model),
        args=(*serve_process.tiny_lora_args(), "--lora-modules", f"ref={tiny_adapters / 'b'}"),
        log_path=server_log.with_name("reference.log"),
    )
    with serve_process.serving(config) as srv:
        out = {}
        for prompt in PROMPTS:
            resp = httpx.post(srv.url + "/v1/completions", json=_body("ref", prompt), timeout=300)
            assert resp.status_code == 200, resp.text
            out[prompt] = resp.json()["choices"][0]["token_ids"]
    return out


@pytest.fixture(scope="module")
def server(reference, tiny_model, root, server_log):
    config = serve_process.ServeConfig(
        model=str(tiny_model),
        args=(
            *serve_process.tiny_lora_args(max_loras=2),  # max_cpu_loras = 2: slot + 1 lease
            "--lora-modules",
            f"policy={root / 'v0'}",
            "--api-key",
            KEY,
            "--art-adapter-root",
            str(root),
        ),
        env={"VLLM_SERVER_DEV_MODE": "1"},  # vLLM's /pause and /resume routes
        log_path=server_log,
    )
    with serve_process.serving(config) as srv:
        yield srv


def call(server, method, route, json=None, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.request(method, server.url + route, json=json, headers=headers, timeout=300)


def publish(server, version: int, path) -> dict:
    resp = call(
        server,
        "POST",
        "/art/v1/lora/update",
        {"slot": "policy", "path": str(path), "version": version},
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def complete(server, model: str, prompt: str) -> httpx.Response:
    return call(server, "POST", "/v1/completions", _body(model, prompt))


async def _steps(client) -> int:
    return (await client.get("/art/v1/engine")).json()["steps"]


async def _eval_across_update(server, model, prompt, path, version):
    """An evaluation request on `model`; version `version` is published to the slot after
    STEPS_BEFORE_UPDATE of its engine steps, while the engine is paused."""
    async with httpx.AsyncClient(base_url=server.url, timeout=300, headers=AUTH) as client:
        s0 = await _steps(client)
        gen = asyncio.create_task(client.post("/v1/completions", json=_body(model, prompt)))
        while await _steps(client) < s0 + STEPS_BEFORE_UPDATE:
            if gen.done():
                pytest.fail("the evaluation ended before the update; no update landed mid-way")
            await asyncio.sleep(0.01)
        paused = await client.post("/pause", params={"mode": "keep", "clear_cache": "false"})
        assert paused.status_code == 200, paused.text
        try:
            upd = await client.post(
                "/art/v1/lora/update",
                json={"slot": "policy", "path": str(path), "version": version},
            )
        finally:
            resumed = await client.post("/resume")
        assert resumed.status_code == 200 and upd.status_code == 200, upd.text
        resp = await gen
    return resp, upd.json(), s0


@pytest.fixture(scope="module")
def leased(server, root):
    """Slot at version 1 (adapter b) and a lease on it."""
    publish(server, 1, root / "v1")
    resp = call(server, "POST", "/art/v1/leases", {"slot": "policy", "version": 1, "ttl_s": 900})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_capabilities_report_exact_leases(server):
    features = call(server, "GET", "/art/v1/capabilities").json()["features"]
    assert features["exact_leases"]["enabled"] is True


def test_lease_answers_with_its_model_name_and_digest(leased, root):
    assert leased["model"] == "policy@1" and leased["version"] == 1
    assert leased["digest"].startswith("xxh3-128:")
    assert leased["digest"] == digest_dir(root / "v1")
    assert leased["expires_at"] - leased["created_at"] == pytest.approx(900)


def test_evaluation_on_a_lease_across_five_updates_is_exact(server, root, leased, reference):
    """Each of five updates lands mid-way through an evaluation on `policy@1`; every
    evaluation returns the fresh server's greedy tokens for adapter b, spans all at 1."""
    for i, (version, _) in enumerate(PLAN[1:]):
        prompt = PROMPTS[i % len(PROMPTS)]
        resp, upd, s0 = asyncio.run(
            _eval_across_update(server, "policy@1", prompt, root / f"v{version}", version)
        )
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert 0 < upd["step"] - s0 < LONG, "the update must land during the evaluation"
        assert upd["version"] == version
        assert choice["policy_spans"] == [
            {"start": 0, "end": LONG, "slot": "policy@1", "version": 1}
        ]
        assert choice["token_ids"] == reference[prompt], f"evaluation {i} (update to v{version})"
    # The slot itself moved on: at v6 (adapter c) its tokens differ from the lease's.
    slot_now = complete(server, "policy", PROMPTS[0])
    assert slot_now.status_code == 200
    assert slot_now.json()["choices"][0]["token_ids"] != reference[PROMPTS[0]]
    assert slot_now.json()["choices"][0]["policy_spans"][0]["version"] == 6


def test_slots_and_leases_list_the_lease(server, leased):
    slots = call(server, "GET", "/art/v1/slots").json()
    (policy,) = [s for s in slots if s["slot"] == "policy"]
    assert [x["id"] for x in policy["leases"]] == [leased["id"]]
    listed = call(server, "GET", "/art/v1/leases").json()
    assert [x["id"] for x in listed] == [leased["id"]]
    models = [
        m["id"]
        for m in httpx.get(server.url + "/v1/models", headers=AUTH, timeout=60).json()["data"]
    ]
    assert "policy@1" in models


@pytest.mark.parametrize(
    ("method", "route"),
    [("POST", "/art/v1/leases"), ("GET", "/art/v1/leases"), ("DELETE", "/art/v1/leases/x")],
)
def test_lease_routes_need_the_key(server, method, route):
    body = {"slot": "policy", "version": 6, "ttl_s": 10}
    assert call(server, method, route, body, key=None).status_code == 401
    assert call(server, method, route, body, key="wrong").status_code == 401


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ([], "body must be a JSON object"),
        ({"slot": "", "version": 1, "ttl_s": 5}, "'slot' must be a non-empty string"),
        ({"slot": "policy", "version": -1, "ttl_s": 5}, "'version' must be a non-negative"),
        ({"slot": "policy", "version": 1, "ttl_s": 0}, "'ttl_s' must be a number"),
        ({"slot": "policy", "version": 1}, "'ttl_s' must be a number"),
    ],
)
def test_bad_lease_bodies_are_400_naming_the_field(server, body, fragment):
    resp = call(server, "POST", "/art/v1/leases", body)
    assert resp.status_code == 400 and fragment in resp.json()["error"]["message"]


def test_unknown_slot_and_unpublished_version_are_404(server, leased):
    resp = call(server, "POST", "/art/v1/leases", {"slot": "nope", "version": 0, "ttl_s": 5})
    assert resp.status_code == 404 and "unknown slot 'nope'" in resp.text
    resp = call(server, "POST", "/art/v1/leases", {"slot": "policy", "version": 99, "ttl_s": 5})
    assert resp.status_code == 404 and "has not committed it" in resp.text


def test_no_capacity_left_is_429_with_the_limit(server, leased):
    resp = call(server, "POST", "/art/v1/leases", {"slot": "policy", "version": 6, "ttl_s": 5})
    assert resp.status_code == 429, resp.text
    err = resp.json()["error"]
    assert err["limit"] == 2 and "max_cpu_loras=2" in err["message"]


def test_a_second_lease_of_the_same_version_shares_the_copy(server, leased):
    resp = call(server, "POST", "/art/v1/leases", {"slot": "policy", "version": 1, "ttl_s": 900})
    assert resp.status_code == 200, resp.text
    second = resp.json()
    assert second["lora_int_id"] == leased["lora_int_id"] and second["id"] != leased["id"]
    gone = call(server, "DELETE", f"/art/v1/leases/{second['id']}")
    assert gone.status_code == 200 and gone.json()["copy_removed"] is False
    assert complete(server, "policy@1", PROMPTS[0]).status_code == 200  # still leased


def test_delete_releases_the_lease(server, leased):
    gone = call(server, "DELETE", f"/art/v1/leases/{leased['id']}")
    assert gone.status_code == 200 and gone.json()["copy_removed"] is True
    resp = complete(server, "policy@1", PROMPTS[0])
    assert resp.status_code == 409 and "no longer served" in resp.text
    again = call(server, "DELETE", f"/art/v1/leases/{leased['id']}")
    assert again.status_code == 404 and "unknown lease" in again.text
    assert call(server, "GET", "/art/v1/leases").json() == []


def _wait_until_released(server, lease_id: str, deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while any(x["id"] == lease_id for x in call(server, "GET", "/art/v1/leases").json()):
        assert time.monotonic() < deadline, f"lease {lease_id} never expired"
        time.sleep(0.1)


def test_expiry_releases_the_lease(server):
    resp = call(server, "POST", "/art/v1/leases", {"slot": "policy", "version": 5, "ttl_s": 2})
    assert resp.status_code == 200, resp.text
    lease = resp.json()
    served = complete(server, "policy@5", PROMPTS[0])
    assert served.status_code == 200, served.text
    assert {s["version"] for s in served.json()["choices"][0]["policy_spans"]} == {5}
    _wait_until_released(server, lease["id"])
    assert complete(server, "policy@5", PROMPTS[0]).status_code == 409
    # The capacity came back: the copy's LoRA was removed (a new lease fits again).
    deadline = time.monotonic() + 60
    while True:
        again = call(
            server, "POST", "/art/v1/leases", {"slot": "policy", "version": 4, "ttl_s": 900}
        )
        if again.status_code != 429:
            break
        assert time.monotonic() < deadline, again.text
        time.sleep(0.1)
    assert again.status_code == 200, again.text
    assert call(server, "DELETE", f"/art/v1/leases/{again.json()['id']}").status_code == 200


def test_a_version_whose_files_are_gone_or_changed_is_404(server, root):
    publish(server, 7, root / "v7")
    publish(server, 8, root / "v8")
    shutil.rmtree(root / "v7")
    resp = call(server, "POST", "/art/v1/leases", {"slot": "policy", "version": 7, "ttl_s": 5})
    assert resp.status_code == 404 and "no longer available" in resp.text
    shutil.rmtree(root / "v3")  # v3 (a) rewritten in place with other weights (b)
    shutil.copytree(root / "v1", root / "v3")
    resp = call(server, "POST", "/art/v1/leases", {"slot": "policy", "version": 3, "ttl_s": 5})
    assert resp.status_code == 404 and "changed since it was committed" in resp.text
