"""In-flight LoRA slot updates with per-token policy spans, on a real `vllm serve`.

The shared plain plugin server (`lora` in tests/support/server_kinds.py): slot `policy` is
handed over on adapter a; `ref_a` and `ref_b` serve adapters a and b loaded by stock vLLM from
their files, as references for exact weights. Tests run in file order and each reads the
slot's current version instead of assuming it.

Mid-generation scenarios are deterministic: the test arms the engine to freeze its running
requests once they have run STEPS_BEFORE_UPDATE engine steps (`POST /art/v1/test/hold`, the
test-only hook, freezes them as vLLM's dev-mode `POST /pause?mode=keep` does, from inside the
engine, so no host timing can let the generation run past it), publishes the update while
nothing steps, and resumes: the update always lands after exactly that step of the running
request (tests/support/step_hold.py). None is retried or skipped.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re

import httpx
import psutil
import pytest
from support.adapters import make_bad_adapters
from support.step_hold import engine_steps, update_after_steps
from support.streamed_ride import ride_a_stream

from art_protocol.client import ArtClient, ArtError, SpanError, validate_spans

PROMPT = "the policy model learns from the reward and the trainer sends"
#: Tokens of a generation an update lands in: the engine holds itself after
#: STEPS_BEFORE_UPDATE steps, so the boundary is within the first dozen tokens and the 8 tokens
#: after it (which the new weights must change) fit (460 before: 3x the CPU, same checks).
LONG = 48
#: Room for the generation the ride test ends itself (tests/support/streamed_ride.py): prompt
#: and tokens fit the server's 512-token context.
RIDE_ROOM = 460
#: Engine steps the generation runs before the test pauses it and publishes an update.
STEPS_BEFORE_UPDATE = 8


@pytest.fixture(scope="module")
def server(lora_server):
    """The shared plain plugin server, with `--max-loras 3` (policy, ref_a and ref_b stay on
    the device) and vLLM's dev-mode /pause and /resume routes."""
    return lora_server


@pytest.fixture(scope="module")
def bad_root(server):
    """Broken adapters, inside the server's allowed adapter roots."""
    return server.scratch


@pytest.fixture(scope="module")
def art(server):
    with ArtClient(server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def versions(art):
    """Hands out strictly increasing versions across the module's tests."""
    counter = itertools.count(1)

    def next_version():
        current = {s["slot"]: s["version"] for s in art.slots()}["policy"]
        return max(current + 1, next(counter))

    return next_version


def _version(art) -> int:
    return {s["slot"]: s["version"] for s in art.slots()}["policy"]


def complete(server, model="policy", max_tokens=64, **extra) -> dict:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    resp = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def preemptions(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=60).text
    return sum(
        float(m) for m in re.findall(r"^vllm:num_preemptions_total\{[^}]*\} (\S+)", text, re.M)
    )


async def _update_mid_generation(server, route, body, path, version):
    """Start a generation, publish an update after STEPS_BEFORE_UPDATE of its engine steps
    (the engine holds itself there: tests/support/step_hold.py).

    Returns (HTTP response, update result, engine step count when the request was sent).
    """
    update = {"slot": "policy", "path": str(path), "version": version}
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        return await update_after_steps(
            client, lambda: client.post(route, json=body), STEPS_BEFORE_UPDATE, update
        )


def update_mid_generation(server, body, path, version, route="/v1/completions"):
    resp, upd, s0 = asyncio.run(_update_mid_generation(server, route, body, path, version))
    assert resp.status_code == 200, resp.text
    return resp.json(), upd, s0


def _reset_to(art, adapter, versions):
    """Put the slot on `adapter` at a new version; returns that version."""

    def reset() -> int:
        return art.update("policy", adapter, versions())["version"]

    return reset


def test_update_mid_generation_switches_at_the_update_step(server, art, versions, tiny_adapters):
    reset = _reset_to(art, tiny_adapters / "a", versions)
    reset()
    baseline = complete(server, max_tokens=LONG)["choices"][0]["token_ids"]
    p0 = preemptions(server)
    body = {
        "model": "policy",
        "prompt": PROMPT,
        "max_tokens": LONG,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    v_before, v_new = _version(art), versions()
    out, upd, s0 = update_mid_generation(server, body, tiny_adapters / "b", v_new)
    choice = out["choices"][0]
    tokens = choice["token_ids"]
    assert len(tokens) == LONG
    spans = validate_spans(choice, LONG, latest_version=v_new)
    assert [(s["slot"], s["version"]) for s in spans] == [("policy", v_before), ("policy", v_new)]
    k = spans[0]["end"]
    assert STEPS_BEFORE_UPDATE <= k < LONG, "the update must land mid-generation"
    # Token i of a request admitted at step s0 is sampled in step s0 + i.
    assert k == upd["step"] - s0
    assert tokens[:k] == baseline[:k]
    assert tokens[k : k + 8] != baseline[k : k + 8], "new weights must change the next tokens"
    assert preemptions(server) == p0, "no request may be preempted by an update"


def test_update_while_the_engine_steps_rides_its_batches(server, art, versions, tiny_adapters):
    """No hold: the update arrives while the engine steps, so its stage and its commit ride
    the next scheduled batches instead of worker RPCs (engine_core/step_rides.py: an RPC
    drains the batches in flight). The switch is as exact as at a hold: the tokens before it
    are the old weights', the ones from the batch that carried the commit the new ones'."""
    reset = _reset_to(art, tiny_adapters / "a", versions)
    reset()
    body = {
        "model": "policy",
        "prompt": PROMPT,
        "max_tokens": RIDE_ROOM,
        "temperature": 0,
        "ignore_eos": True,
    }
    v_before, v_new = _version(art), versions()
    update = {"slot": "policy", "path": str(tiny_adapters / "b"), "version": v_new}

    def settled(ride) -> bool:
        """Stage, commit and the finish's final ride (the workers drop their undo copy) went
        to the workers, and the 8 tokens after the switch have arrived."""
        return ride.rides() + ride.rides("flushed") >= 3 and ride.tokens_of(v_new) >= 8

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            return await ride_a_stream(client, body, update, tokens_before=2, settled=settled)

    ride = asyncio.run(run())
    upd, before, after = ride.update, ride.before, ride.after
    assert upd.status_code == 200, upd.text
    stepped, flushed = ride.rides(), ride.rides("flushed")
    # Stage and commit rode batches (no RPC while the engine stepped); the finish's final ride
    # (the workers drop their undo copy) rides the next batch, or goes as one RPC if the
    # generation ended first: nothing was left to drain then.
    assert stepped >= 2 and stepped + flushed == 3, (stepped, flushed)
    tokens = ride.tokens
    spans = validate_spans(ride.choice, len(tokens), latest_version=v_new)
    assert [(s["slot"], s["version"]) for s in spans] == [("policy", v_before), ("policy", v_new)]
    k = spans[0]["end"]
    assert k == upd.json()["step"] - ride.s0
    # adapter a's greedy tokens (ref_a serves it; the slot served it before the switch)
    baseline = complete(server, "ref_a", max_tokens=len(tokens))["choices"][0]["token_ids"]
    assert tokens[:k] == baseline[:k]
    assert tokens[k : k + 8] != baseline[k : k + 8], "new weights must change the next tokens"
    assert after["label_mismatches"] == before["label_mismatches"]


def test_step_labels_come_from_the_workers_and_agree_with_the_engine(
    server, art, versions, tiny_adapters
):
    """After an update every step carries the label its worker recorded at the forward
    (worker/forward_labels.py), and that label is the one the spans report; on this executor
    (multiprocessing) EngineCore's own stamp never disagrees with it."""
    version = art.update("policy", tiny_adapters / "b", versions())["version"]
    before = httpx.get(server.url + "/art/v1/engine", timeout=60).json()
    out = complete(server, max_tokens=12)
    after = httpx.get(server.url + "/art/v1/engine", timeout=60).json()
    assert after["worker_labelled"] - before["worker_labelled"] >= 12
    assert after["label_mismatches"] == 0
    spans = validate_spans(out["choices"][0], 12, latest_version=version)
    assert [(s["slot"], s["version"]) for s in spans] == [("policy", version)]


#: Tokens per choice of the n=4 test: the update lands after STEPS_BEFORE_UPDATE engine steps
#: (the engine holds itself there), so each child's boundary is within its first dozen tokens;
#: 460 tokens x 4 choices x 2 runs took 47 s under MRV2 for the same check.
N4_TOKENS = 48


def test_update_with_n4_gives_each_choice_its_spans(server, art, versions, tiny_adapters):
    reset = _reset_to(art, tiny_adapters / "a", versions)
    reset()
    sampling = {"n": 4, "temperature": 0.9, "seed": 7}
    baseline = complete(server, max_tokens=N4_TOKENS, **sampling)["choices"]
    body = {
        "model": "policy",
        "prompt": PROMPT,
        "max_tokens": N4_TOKENS,
        "ignore_eos": True,
        "return_token_ids": True,
        **sampling,
    }
    v_before, v_new = _version(art), versions()
    out, _, _ = update_mid_generation(server, body, tiny_adapters / "b", v_new)
    assert len(out["choices"]) == 4
    boundaries = set()
    for choice, base in zip(out["choices"], baseline, strict=True):
        spans = validate_spans(choice, N4_TOKENS, latest_version=v_new)
        assert [s["version"] for s in spans] == [v_before, v_new]
        k = spans[0]["end"]
        boundaries.add(k)
        assert choice["token_ids"][:k] == base["token_ids"][:k]
    # Children may be admitted in different steps; the update reached each of them mid-way.
    assert all(0 < k < N4_TOKENS for k in boundaries)


def test_update_during_chat_completion(server, art, versions, tiny_adapters):
    body = {
        "model": "policy",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": LONG,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    v_before, v_new = _version(art), versions()
    out, _, _ = update_mid_generation(
        server, body, tiny_adapters / "c", v_new, route="/v1/chat/completions"
    )
    choice = out["choices"][0]
    assert out["usage"]["completion_tokens"] == LONG
    spans = validate_spans(choice, LONG, latest_version=v_new)
    assert [s["version"] for s in spans] == [v_before, v_new]


def test_after_update_slot_serves_exactly_the_new_weights(server, art, versions, tiny_adapters):
    art.update("policy", tiny_adapters / "b", versions())
    got = complete(server, "policy", max_tokens=96)["choices"][0]
    ref = complete(server, "ref_b", max_tokens=96)["choices"][0]
    assert got["token_ids"] == ref["token_ids"]
    assert got["policy_spans"] == [
        {"start": 0, "end": 96, "slot": "policy", "version": _version(art)}
    ]
    ref_a = complete(server, "ref_a", max_tokens=96)["choices"][0]
    assert ref_a["token_ids"] != ref["token_ids"], "adapters a and b must differ"


def test_base_model_choices_carry_a_null_slot_span(server, tiny_model):
    out = complete(server, model=str(tiny_model), max_tokens=10)
    assert out["choices"][0]["policy_spans"] == [
        {"start": 0, "end": 10, "slot": None, "version": 0}
    ]


BAD = [
    "missing_path",
    "truncated_safetensors",
    "rank_over_max",
    "rank_mismatch",
    "wrong_shape",
    "nan",
    "wrong_targets",
]


@pytest.fixture(scope="module")
def bad_adapters(tiny_adapters, bad_root):
    return make_bad_adapters(tiny_adapters / "c", bad_root)


@pytest.mark.parametrize("case", BAD)
def test_bad_adapter_is_refused_and_old_weights_keep_serving(server, art, bad_adapters, case):
    before_version = _version(art)
    before = complete(server, max_tokens=24)["choices"][0]
    path, fragment = bad_adapters[case]
    with pytest.raises(ArtError) as err:
        art.update("policy", path, before_version + 1)
    assert err.value.status == 422
    assert fragment in err.value.message
    assert f"keeps serving version {before_version}" in err.value.message
    assert _version(art) == before_version
    after = complete(server, max_tokens=24)["choices"][0]
    assert after["token_ids"] == before["token_ids"]
    assert after["policy_spans"][0]["version"] == before_version


def test_stale_version_and_unknown_slot_and_malformed_request(server, art, tiny_adapters):
    current = _version(art)
    with pytest.raises(ArtError) as err:
        art.update("policy", tiny_adapters / "a", current)
    assert err.value.status == 409 and f"current version {current}" in err.value.message
    with pytest.raises(ArtError) as err:
        art.update("nope", tiny_adapters / "a", current + 1)
    assert err.value.status == 404 and "unknown slot 'nope'" in err.value.message
    for body in ({"slot": "policy"}, {"slot": "policy", "path": "x", "version": "7"}, [1, 2]):
        resp = httpx.post(server.url + "/art/v1/lora/update", json=body, timeout=60)
        assert resp.status_code == 400, (body, resp.text)
    resp = httpx.post(
        server.url + "/art/v1/lora/update",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert resp.status_code == 400
    assert _version(art) == current


async def _stream(server, route, body, update=None):
    """Stream `body`; returns {choice index: merged chunk spans}, token counts, errors.

    With `update=(path, version)`, publishes it once the engine ran STEPS_BEFORE_UPDATE steps of
    the stream (the engine holds itself there: tests/support/step_hold.py).
    """
    spans: dict[int, list] = {}
    chunks_with_tokens: dict[int, int] = {}
    errors = []
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:

        async def consume():
            async with client.stream("POST", route, json={**body, "stream": True}) as resp:
                assert resp.status_code == 200, await resp.aread()
                async for line in resp.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    payload = json.loads(line[len("data: ") :])
                    if "error" in payload:
                        errors.append(payload["error"])
                    for choice in payload.get("choices") or ():
                        for span in choice.get("policy_spans") or ():
                            merged = spans.setdefault(choice["index"], [])
                            if (
                                merged
                                and merged[-1]["end"] == span["start"]
                                and (merged[-1]["version"] == span["version"])
                            ):
                                merged[-1]["end"] = span["end"]
                            else:
                                merged.append(dict(span))
                        if choice.get("policy_spans"):
                            chunks_with_tokens[choice["index"]] = (
                                chunks_with_tokens.get(choice["index"], 0) + 1
                            )

        if update is None:
            upd, s0 = None, await engine_steps(client)
            await consume()
        else:
            path, version = update
            body_ = {"slot": "policy", "path": str(path), "version": version}
            _, upd, s0 = await update_after_steps(client, consume, STEPS_BEFORE_UPDATE, body_)
    return spans, chunks_with_tokens, errors, upd, s0


def test_streaming_spans_concatenate_to_the_non_streaming_spans(server, art):
    body = {
        "model": "policy",
        "prompt": PROMPT,
        "max_tokens": 40,
        "n": 2,
        "temperature": 0.9,
        "seed": 11,
        "ignore_eos": True,
    }
    full = httpx.post(server.url + "/v1/completions", json=body, timeout=300).json()
    spans, chunks, errors, _, _ = asyncio.run(_stream(server, "/v1/completions", body))
    assert not errors
    assert sorted(spans) == [0, 1]
    for choice in full["choices"]:
        assert spans[choice["index"]] == choice["policy_spans"]
        assert chunks[choice["index"]] > 1, "spans arrive chunk by chunk, not at the end"


def test_streaming_chat_carries_spans(server, art):
    body = {
        "model": "policy",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
    }
    spans, _, errors, _, _ = asyncio.run(_stream(server, "/v1/chat/completions", body))
    assert not errors
    validate_spans({"policy_spans": spans[0]}, 24, latest_version=_version(art))


def test_streaming_through_a_mid_stream_update(server, art, versions, tiny_adapters):
    body = {
        "model": "policy",
        "prompt": PROMPT,
        "max_tokens": LONG,
        "temperature": 0,
        "ignore_eos": True,
    }
    v = _version(art)
    spans, _, errors, upd, _ = asyncio.run(
        _stream(server, "/v1/completions", body, update=(tiny_adapters / "c", versions()))
    )
    assert not errors
    merged = validate_spans({"policy_spans": spans[0]}, LONG, latest_version=upd["version"])
    assert [s["version"] for s in merged] == [v, upd["version"]]


def test_streaming_on_a_replaced_alias_ends_with_an_error(server, art, versions, tiny_adapters):
    v = _version(art)
    body = {
        "model": f"policy@{v}",
        "prompt": PROMPT,
        "max_tokens": LONG,
        "temperature": 0,
        "ignore_eos": True,
    }
    spans, _, errors, upd, s0 = asyncio.run(
        _stream(server, "/v1/completions", body, update=(tiny_adapters / "a", versions()))
    )
    assert errors and errors[0]["code"] == 409, (errors, spans, upd, s0)
    assert f"policy@{v} was replaced" in errors[0]["message"]
    assert {s["version"] for s in spans[0]} == {v}, "no token of another version is sent"


def test_validate_spans_rejects_gaps_overlaps_and_future_versions():
    ok = {
        "policy_spans": [
            {"start": 0, "end": 3, "slot": "p", "version": 1},
            {"start": 3, "end": 5, "slot": "p", "version": 2},
        ]
    }
    assert validate_spans(ok, 5, latest_version=2)
    cases = [
        (
            {
                "policy_spans": [
                    {"start": 0, "end": 2, "slot": "p", "version": 1},
                    {"start": 3, "end": 5, "slot": "p", "version": 1},
                ]
            },
            5,
            1,
            "gap",
        ),
        (
            {
                "policy_spans": [
                    {"start": 0, "end": 3, "slot": "p", "version": 1},
                    {"start": 2, "end": 5, "slot": "p", "version": 1},
                ]
            },
            5,
            1,
            "overlaps",
        ),
        (ok, 6, 2, "cover 5 tokens"),
        (ok, 5, 1, "newer than the latest"),
        (ok, 5, {"p": 1}, "newer than the latest"),
        (ok, 5, {"other": 9}, "slot 'p' has no latest version"),
        ({}, 0, 0, "no policy_spans"),
    ]
    for choice, n, latest, fragment in cases:
        with pytest.raises(SpanError, match=fragment):
            validate_spans(choice, n, latest_version=latest)


def test_validate_spans_always_checks_for_future_versions():
    """The future-version check runs in every call: there is no call that skips it."""
    future = {"policy_spans": [{"start": 0, "end": 2, "slot": "p", "version": 7}]}
    with pytest.raises(TypeError):
        validate_spans(future, 2)  # latest_version is required
    with pytest.raises(TypeError, match="needs latest_version"):
        validate_spans(future, 2, latest_version=None)
    with pytest.raises(SpanError, match="newer than the latest"):
        validate_spans(future, 2, 6)
    base = {"policy_spans": [{"start": 0, "end": 2, "slot": None, "version": 0}]}
    assert validate_spans(base, 2, latest_version={"p": 6})


def test_client_latest_versions_feed_validate_spans(server, art):
    latest = art.latest_versions()
    assert latest == {s["slot"]: s["version"] for s in art.slots()}
    choice = complete(server, max_tokens=8)["choices"][0]
    assert validate_spans(choice, 8, latest_version=latest)


def _alias_request(server, model, max_tokens=16):
    return httpx.post(
        server.url + "/v1/completions",
        timeout=300,
        json={
            "model": model,
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
    )


def test_exact_alias_serves_only_its_version(server, art, versions, tiny_adapters):
    v = _version(art)
    assert {s["slot"]: s["alias"] for s in art.slots()}["policy"] == f"policy@{v}"
    ok = _alias_request(server, f"policy@{v}")
    assert ok.status_code == 200, ok.text
    assert {s["version"] for s in ok.json()["choices"][0]["policy_spans"]} == {v}
    art.update("policy", tiny_adapters / "a", versions())
    v2 = _version(art)
    stale = _alias_request(server, f"policy@{v}")
    assert stale.status_code == 409
    assert stale.json()["error"]["message"] == (
        f"policy@{v} is no longer served; current is policy@{v2}"
    )
    future = _alias_request(server, f"policy@{v2 + 5}")
    assert future.status_code == 409 and "not published yet" in future.json()["error"]["message"]
    assert _alias_request(server, f"policy@{v2}").status_code == 200
    assert {s["slot"]: s["alias"] for s in art.slots()}["policy"] == f"policy@{v2}"


def test_alias_response_is_withheld_when_replaced_mid_generation(
    server, art, versions, tiny_adapters
):
    v = _version(art)
    body = {
        "model": f"policy@{v}",
        "prompt": PROMPT,
        "max_tokens": LONG,
        "temperature": 0,
        "ignore_eos": True,
    }
    resp, upd, s0 = asyncio.run(
        _update_mid_generation(server, "/v1/completions", body, tiny_adapters / "b", versions())
    )
    assert resp.status_code == 409, (resp.text, upd, s0)
    assert f"policy@{v} was replaced by policy@{upd['version']}" in resp.json()["error"]["message"]


async def _ordinary_streams(server, streams: int, concurrency: int = 16) -> list:
    errors: list = []
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int):
            async with gate:
                body = {
                    "model": "policy",
                    "prompt": f"{PROMPT} {i}",
                    "max_tokens": 4,
                    "temperature": 0,
                    "stream": True,
                }
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        errors.append((resp.status_code, (await resp.aread())[:200]))
                        return
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {") and '"error"' in line:
                            errors.append(json.loads(line[len("data: ") :])["error"])

        await asyncio.gather(*(one(i) for i in range(streams)))
    return errors


def test_refused_alias_streams_leave_no_alias_behind(server, art, versions, tiny_adapters):
    """A streaming alias request refused before its generator starts must not leave its alias
    for a later request to find: 300 ordinary streams after 200 refused ones end without a
    single (false) 409, also after the slot moved on."""
    v = _version(art)

    async def refused_streams() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            return [
                (
                    await client.post(
                        "/v1/completions",
                        json={
                            "model": f"policy@{v}",
                            "prompt": PROMPT,
                            "max_tokens": 4,
                            "stream": True,
                            "use_beam_search": True,  # refused before any generator exists
                        },
                    )
                ).status_code
                for _ in range(200)
            ]

    statuses = asyncio.run(refused_streams())
    assert set(statuses) == {400}, statuses
    art.update("policy", tiny_adapters / "b", versions())  # every leaked alias is now stale
    errors = asyncio.run(_ordinary_streams(server, 300))
    assert errors == [], f"{len(errors)} of 300 streams failed, first: {errors[:3]}"


# Load and soak-like tests last: they leave the server busiest.
async def _race(server, adapters, start_version):
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:

        async def request(i):
            await asyncio.sleep(0.05 * i)
            return await client.post(
                "/v1/completions",
                json={
                    "model": "policy",
                    "prompt": f"{PROMPT} {i}",
                    "max_tokens": 48 + 4 * i,
                    "temperature": 0.7,
                    "seed": i,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
            )

        async def update(j):
            await asyncio.sleep(0.08 * j)
            return start_version + j, await client.post(
                "/art/v1/lora/update",
                json={"slot": "policy", "path": str(adapters[j % 3]), "version": start_version + j},
            )

        results = await asyncio.gather(
            *(request(i) for i in range(16)), *(update(j) for j in range(20))
        )
    return results[:16], results[16:]


def test_twenty_updates_race_sixteen_requests(server, art, versions, tiny_adapters):
    start = versions()
    adapters = [tiny_adapters / n for n in ("a", "b", "c")]
    requests, updates = asyncio.run(_race(server, adapters, start))
    committed = [v for v, resp in updates if resp.status_code == 200]
    assert all(resp.status_code in (200, 409) for _, resp in updates), [
        resp.text for _, resp in updates if resp.status_code not in (200, 409)
    ]
    assert committed, "at least one update must commit"
    for resp in requests:
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        spans = validate_spans(choice, len(choice["token_ids"]), latest_version=max(committed))
        versions_in_order = [s["version"] for s in spans]
        assert versions_in_order == sorted(versions_in_order)
    assert _version(art) == max(committed)


def _worker_rss(server) -> int:
    procs = psutil.Process(server.proc.pid).children(recursive=True)
    workers = [p for p in procs if "Worker" in p.name()]
    assert workers, [p.name() for p in procs]
    return sum(p.memory_info().rss for p in workers)


def test_memory_does_not_grow_over_200_updates(server, art, versions, tiny_adapters):
    adapters = [tiny_adapters / n for n in ("a", "b", "c")]
    for j in range(20):  # warm-up: allocator pools and caches settle
        art.update("policy", adapters[j % 3], versions())
    rss0 = _worker_rss(server)
    for j in range(200):
        art.update("policy", adapters[j % 3], versions())
    growth = _worker_rss(server) - rss0
    # Each adapter is ~130 KB; a leak of one copy per update would be >= 26 MB.
    assert growth < 16 * 2**20, f"worker RSS grew {growth / 2**20:.1f} MiB over 200 updates"
