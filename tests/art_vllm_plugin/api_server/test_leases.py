"""Exact leases (`POST/GET/DELETE /art/v1/leases`), on a real `vllm serve`.

The shared `keyed` server (tests/support/server_kinds.py) hands over slot `policy` on adapter a
at version `base`; its LoRA module `ref_b` is adapter b loaded by stock vLLM from its files,
whose greedy tokens are the reference. Version base+1 (b) is leased; then five updates of the
slot land *in the middle of* evaluation requests on `policy@<base+1>` (the engine freezes
itself after a given step while the update is published: tests/support/step_hold.py), and every
evaluation must return exactly the reference tokens with every span at version base+1. Then the
refusals (401, 400, 404, 429) and the releases (DELETE, expiry) on the same server. Tests run
in file order.
"""

from __future__ import annotations

import asyncio
import shutil
import time

import httpx
import pytest
from support.server_kinds import KEYED_API_KEY as KEY
from support.step_hold import update_after_steps

from art_protocol.digest import digest_dir

PROMPTS = [
    "the policy model learns from the reward and the trainer sends",
    "exact evaluation of one version while the slot keeps moving",
]
#: Tokens of an evaluation: the engine holds itself after STEPS_BEFORE_UPDATE steps, so every
#: update lands within its first dozen tokens, and the rest are the lease's after the update
#: (120 before: the same checks at 2.5x the tokens).
LONG = 48
STEPS_BEFORE_UPDATE = 6
#: (version - base, tiny adapter) published to slot `policy` after `base` (= a); base+1 is
#: leased.
PLAN = [(1, "b"), (2, "c"), (3, "a"), (4, "c"), (5, "a"), (6, "c")]
AUTH = {"Authorization": f"Bearer {KEY}"}
#: The keyed server's `--max-cpu-loras`: its two LoRA modules (policy, ref_b) and one lease.
MAX_CPU_LORAS = 3


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
def server(keyed_server):
    """The shared `keyed` server: `--api-key`, `--max-loras 2 --max-cpu-loras 3`, vLLM's
    dev-mode /is_paused and /resume routes, the test-only step hold."""
    return keyed_server


@pytest.fixture(scope="module")
def base(server) -> int:
    """The slot's version when this module starts (adapter a)."""
    return server.start_versions["policy"]


@pytest.fixture(scope="module")
def root(server, tiny_adapters):
    """Adapter directories `v<k>` for version base+k (as a trainer writes them), inside the
    server's allowed adapter root."""
    root = server.scratch
    for k, name in PLAN:
        shutil.copytree(tiny_adapters / name, root / f"v{k}")
    for k, name in ((7, "b"), (8, "a")):
        shutil.copytree(tiny_adapters / name, root / f"v{k}")
    return root


@pytest.fixture(scope="module")
def reference(server):
    """Greedy tokens of adapter b as stock vLLM loads it from its files (LoRA module `ref_b`,
    never updated)."""
    out = {}
    for prompt in PROMPTS:
        resp = call(server, "POST", "/v1/completions", _body("ref_b", prompt))
        assert resp.status_code == 200, resp.text
        out[prompt] = resp.json()["choices"][0]["token_ids"]
    return out


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


async def _eval_across_update(server, model, prompt, path, version):
    """An evaluation request on `model`; version `version` is published to the slot after
    STEPS_BEFORE_UPDATE of its engine steps (the engine holds itself there:
    tests/support/step_hold.py)."""
    update = {"slot": "policy", "path": str(path), "version": version}
    async with httpx.AsyncClient(base_url=server.url, timeout=300, headers=AUTH) as client:
        return await update_after_steps(
            client,
            lambda: client.post("/v1/completions", json=_body(model, prompt)),
            STEPS_BEFORE_UPDATE,
            update,
        )


@pytest.fixture(scope="module")
def leased(server, root, base, reference):
    """Slot at version base+1 (adapter b) and a lease on it (released by
    test_delete_releases_the_lease)."""
    publish(server, base + 1, root / "v1")
    body = {"slot": "policy", "version": base + 1, "ttl_s": 900}
    resp = call(server, "POST", "/art/v1/leases", body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_capabilities_report_exact_leases(server):
    features = call(server, "GET", "/art/v1/capabilities").json()["features"]
    assert features["exact_leases"]["enabled"] is True


def test_lease_answers_with_its_model_name_and_digest(leased, root, base):
    assert leased["model"] == f"policy@{base + 1}" and leased["version"] == base + 1
    assert leased["digest"].startswith("xxh3-128:")
    assert leased["digest"] == digest_dir(root / "v1")
    assert leased["expires_at"] - leased["created_at"] == pytest.approx(900)


def test_evaluation_on_a_lease_across_five_updates_is_exact(server, root, leased, reference, base):
    """Each of five updates lands mid-way through an evaluation on `policy@<base+1>`; every
    evaluation returns stock vLLM's greedy tokens for adapter b, spans all at base+1."""
    lease = f"policy@{base + 1}"
    for i, (k, _) in enumerate(PLAN[1:]):
        prompt = PROMPTS[i % len(PROMPTS)]
        version = base + k
        resp, upd, s0 = asyncio.run(
            _eval_across_update(server, lease, prompt, root / f"v{k}", version)
        )
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert 0 < upd["step"] - s0 < LONG, "the update must land during the evaluation"
        assert upd["version"] == version
        assert choice["policy_spans"] == [
            {"start": 0, "end": LONG, "slot": lease, "version": base + 1}
        ]
        assert choice["token_ids"] == reference[prompt], f"evaluation {i} (update to v{version})"
    # The slot itself moved on: at base+6 (adapter c) its tokens differ from the lease's.
    slot_now = complete(server, "policy", PROMPTS[0])
    assert slot_now.status_code == 200
    assert slot_now.json()["choices"][0]["token_ids"] != reference[PROMPTS[0]]
    assert slot_now.json()["choices"][0]["policy_spans"][0]["version"] == base + 6


def test_slots_and_leases_list_the_lease(server, leased, base):
    slots = call(server, "GET", "/art/v1/slots").json()
    (policy,) = [s for s in slots if s["slot"] == "policy"]
    assert [x["id"] for x in policy["leases"]] == [leased["id"]]
    listed = call(server, "GET", "/art/v1/leases").json()
    assert [x["id"] for x in listed] == [leased["id"]]
    models = [
        m["id"]
        for m in httpx.get(server.url + "/v1/models", headers=AUTH, timeout=60).json()["data"]
    ]
    assert f"policy@{base + 1}" in models


@pytest.mark.parametrize(
    ("method", "route"),
    [("POST", "/art/v1/leases"), ("GET", "/art/v1/leases"), ("DELETE", "/art/v1/leases/x")],
)
def test_lease_routes_need_the_key(server, base, method, route):
    body = {"slot": "policy", "version": base + 6, "ttl_s": 10}
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


def test_unknown_slot_and_unpublished_version_are_404(server, leased, base):
    resp = call(server, "POST", "/art/v1/leases", {"slot": "nope", "version": 0, "ttl_s": 5})
    assert resp.status_code == 404 and "unknown slot 'nope'" in resp.text
    body = {"slot": "policy", "version": base + 99, "ttl_s": 5}
    resp = call(server, "POST", "/art/v1/leases", body)
    assert resp.status_code == 404 and "has not committed it" in resp.text


def test_no_capacity_left_is_429_with_the_limit(server, leased, base):
    body = {"slot": "policy", "version": base + 6, "ttl_s": 5}
    resp = call(server, "POST", "/art/v1/leases", body)
    assert resp.status_code == 429, resp.text
    err = resp.json()["error"]
    assert err["limit"] == MAX_CPU_LORAS and f"max_cpu_loras={MAX_CPU_LORAS}" in err["message"]


def test_a_second_lease_of_the_same_version_shares_the_copy(server, leased, base):
    body = {"slot": "policy", "version": base + 1, "ttl_s": 900}
    resp = call(server, "POST", "/art/v1/leases", body)
    assert resp.status_code == 200, resp.text
    second = resp.json()
    assert second["lora_int_id"] == leased["lora_int_id"] and second["id"] != leased["id"]
    gone = call(server, "DELETE", f"/art/v1/leases/{second['id']}")
    assert gone.status_code == 200 and gone.json()["copy_removed"] is False
    assert complete(server, f"policy@{base + 1}", PROMPTS[0]).status_code == 200  # still leased


def test_delete_releases_the_lease(server, leased, base):
    gone = call(server, "DELETE", f"/art/v1/leases/{leased['id']}")
    assert gone.status_code == 200 and gone.json()["copy_removed"] is True
    resp = complete(server, f"policy@{base + 1}", PROMPTS[0])
    assert resp.status_code == 409 and "no longer served" in resp.text
    again = call(server, "DELETE", f"/art/v1/leases/{leased['id']}")
    assert again.status_code == 404 and "unknown lease" in again.text
    assert call(server, "GET", "/art/v1/leases").json() == []


def _wait_until_released(server, lease_id: str, deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while any(x["id"] == lease_id for x in call(server, "GET", "/art/v1/leases").json()):
        assert time.monotonic() < deadline, f"lease {lease_id} never expired"
        time.sleep(0.1)


def test_expiry_releases_the_lease(server, base):
    body = {"slot": "policy", "version": base + 5, "ttl_s": 2}
    resp = call(server, "POST", "/art/v1/leases", body)
    assert resp.status_code == 200, resp.text
    lease = resp.json()
    served = complete(server, f"policy@{base + 5}", PROMPTS[0])
    assert served.status_code == 200, served.text
    assert {s["version"] for s in served.json()["choices"][0]["policy_spans"]} == {base + 5}
    _wait_until_released(server, lease["id"])
    assert complete(server, f"policy@{base + 5}", PROMPTS[0]).status_code == 409
    # The capacity came back: the copy's LoRA was removed (a new lease fits again).
    deadline = time.monotonic() + 60
    while True:
        again = call(
            server, "POST", "/art/v1/leases", {"slot": "policy", "version": base + 4, "ttl_s": 900}
        )
        if again.status_code != 429:
            break
        assert time.monotonic() < deadline, again.text
        time.sleep(0.1)
    assert again.status_code == 200, again.text
    assert call(server, "DELETE", f"/art/v1/leases/{again.json()['id']}").status_code == 200


def test_a_version_whose_files_are_gone_or_changed_is_404(server, root, base):
    publish(server, base + 7, root / "v7")
    publish(server, base + 8, root / "v8")
    shutil.rmtree(root / "v7")
    body = {"slot": "policy", "version": base + 7, "ttl_s": 5}
    resp = call(server, "POST", "/art/v1/leases", body)
    assert resp.status_code == 404 and "no longer available" in resp.text
    shutil.rmtree(root / "v3")  # base+3 (a) rewritten in place with other weights (b)
    shutil.copytree(root / "v1", root / "v3")
    body = {"slot": "policy", "version": base + 3, "ttl_s": 5}
    resp = call(server, "POST", "/art/v1/leases", body)
    assert resp.status_code == 404 and "changed since it was committed" in resp.text
