"""A slot whose update left its state unknown is blocked until an update of it commits cleanly.

The update is answered 503 ("state unknown": a worker may hold the new weights under the old
label). From then on every request on the slot fails with 503 naming the failed update: the
one running when it failed (held at an exact engine step, tests/support/step_hold.py's
mechanism), streamed or not, and every new one (completion, chat, the `slot@N` alias). Other
slots keep serving, and the next clean update of the slot unblocks it.

"State unknown" is forced with the test-only fault hook (`ART_TEST_HOOKS=1`,
`{"kind": "unknown"}`): worker 0 fails its commit and the engine reports that the restore
failed, as when a worker cannot put its previous weights back.

The shared plain plugin server (`lora`: slots policy, other, ref_a, ref_b, the fault hook, dev
mode for the step hold).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

PROMPT = "the policy model learns from the reward and the trainer sends"
#: Long enough to still run at the held step, short for MRV2 on two cores.
MAX_TOKENS = 12
HOLD_AFTER = 2


@pytest.fixture(scope="module")
def server(lora_server):
    """The shared plain plugin server (`lora` in tests/support/server_kinds.py)."""
    return lora_server


def completion(model: str, max_tokens: int = 4, stream: bool = False) -> dict:
    return {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def error_message(resp: httpx.Response) -> str:
    return resp.json()["error"]["message"]


async def _stream_events(client: httpx.AsyncClient, body: dict) -> list[dict]:
    events = []
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[len("data: ") :]))
    return events


async def _slots(client: httpx.AsyncClient) -> dict[str, dict]:
    return {s["slot"]: s for s in (await client.get("/art/v1/slots")).json()}


async def _scenario(url: str, adapters) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        v = (await _slots(client))["policy"]["version"]
        op = f"unknown-{time.time_ns()}"
        s0 = (await client.get("/art/v1/engine")).json()["steps"]
        armed = await client.post("/art/v1/test/hold", json={"step": s0 + HOLD_AFTER})
        assert armed.status_code == 200, armed.text
        running = asyncio.create_task(
            client.post("/v1/completions", json=completion("policy", MAX_TOKENS))
        )
        streamed = asyncio.create_task(
            _stream_events(client, completion("policy", MAX_TOKENS, stream=True))
        )
        out: dict = {"v": v, "op": op}
        try:
            while not (await client.get("/is_paused")).json()["is_paused"]:
                if running.done():
                    pytest.fail(f"the generation ended before step {s0 + HOLD_AFTER}")
                await asyncio.sleep(0.01)
            try:
                fault = await client.post("/art/v1/test/fault", json={"kind": "unknown", "rank": 0})
                assert fault.status_code == 200, fault.text
                out["update"] = await client.post(
                    "/art/v1/lora/update",
                    json={
                        "slot": "policy",
                        "path": str(adapters / "b"),
                        "version": v + 1,
                        "operation_id": op,
                    },
                )
                upd = out["update"]
                assert upd.status_code == 503, upd.text  # (a 200 would leave nothing blocked)
                # Answered by the API server while the engine is still held.
                out["new"] = await client.post("/v1/completions", json=completion("policy"))
            finally:
                resumed = await client.post("/resume")
                assert resumed.status_code == 200, resumed.text
            out["running"] = await running
            out["streamed"] = await streamed
        finally:
            for task in (running, streamed):
                if not task.done():
                    task.cancel()
        out["alias"] = await client.post("/v1/completions", json=completion(f"policy@{v}"))
        out["chat"] = await client.post(
            "/v1/chat/completions",
            json={
                "model": "policy",
                "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": 4,
            },
        )
        out["new_stream"] = await client.post(
            "/v1/completions", json=completion("policy", stream=True)
        )
        out["other_slot"] = await client.post("/v1/completions", json=completion("ref_a"))
        out["slots_blocked"] = await _slots(client)
        out["engine_blocked"] = (await client.get("/art/v1/engine")).json()["blocked"]
        out["clean"] = await client.post(
            "/art/v1/lora/update",
            json={"slot": "policy", "path": str(adapters / "a"), "version": v + 1},
        )
        out["after"] = await client.post("/v1/completions", json=completion("policy"))
        out["slots_after"] = await _slots(client)
        out["engine_after"] = (await client.get("/art/v1/engine")).json()["blocked"]
        return out


def test_an_update_left_unknown_blocks_its_slot_until_a_clean_update(server, tiny_adapters):
    out = asyncio.run(_scenario(server.url, tiny_adapters))
    v, op = out["v"], out["op"]
    names_the_update = (f"update to version {v + 1}", f"operation_id '{op}'", "blocked")

    upd = out["update"]
    assert upd.status_code == 503, upd.text
    assert "unknown" in error_message(upd) and "refused (503) until an update" in upd.text

    # New requests on the slot, in every form: 503 naming the failed update.
    for what in ("new", "alias", "chat", "new_stream"):
        resp = out[what]
        assert resp.status_code == 503, (what, resp.text)
        assert all(part in error_message(resp) for part in names_the_update), (what, resp.text)

    # The requests that were running when it failed end with 503 too, not 500 or tokens.
    running = out["running"]
    assert running.status_code == 503, running.text
    assert all(part in error_message(running) for part in names_the_update), running.text
    errors = [e["error"] for e in out["streamed"] if "error" in e]
    assert len(errors) == 1 and errors[0]["code"] == 503, out["streamed"]
    assert all(part in errors[0]["message"] for part in names_the_update), errors

    # Other slots keep serving; the registry and the engine say which slot is blocked.
    assert out["other_slot"].status_code == 200, out["other_slot"].text
    blocked = out["slots_blocked"]
    assert all(part in blocked["policy"]["blocked"] for part in names_the_update), blocked
    assert blocked["policy"]["version"] == v  # the failed version was never committed
    assert {s["blocked"] for name, s in blocked.items() if name != "policy"} == {None}
    assert list(out["engine_blocked"]) == ["policy"]

    # A later update that commits cleanly unblocks the slot.
    assert out["clean"].status_code == 200, out["clean"].text
    assert out["after"].status_code == 200, out["after"].text
    assert out["slots_after"]["policy"]["blocked"] is None
    assert out["slots_after"]["policy"]["version"] == v + 1
    assert out["engine_after"] == {}
