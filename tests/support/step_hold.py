"""Publish an update after an exact engine step of a running generation.

A client's `POST /pause?mode=keep` lands wherever the host's timing puts it: with the train
suite running beside a `-tp 2` server on two cores, a 96-token generation had ended before
the pause arrived. So the engine freezes itself: `POST /art/v1/test/hold` (ART_TEST_HOOKS=1)
arms it to freeze its running requests once it has completed a given step, as
`/pause?mode=keep` does; the test waits until engine 0 says it is paused (`GET /art/v1/engine`:
vLLM's `GET /is_paused` fails while data-parallel engines disagree), publishes, and resumes
with `POST /resume`. The update then lands after exactly that step on every host.

The server needs `ART_TEST_HOOKS=1` and `VLLM_SERVER_DEV_MODE=1`, and nothing else may run on
it meanwhile (another request's steps would count too).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest


async def engine_steps(client: httpx.AsyncClient) -> int:
    """Completed engine steps (`GET /art/v1/engine`)."""
    return (await client.get("/art/v1/engine")).json()["steps"]


async def update_after_steps(
    client: httpx.AsyncClient,
    generation: Callable[[], Awaitable[Any]],
    steps: int,
    update: dict | Callable[[], dict],
    headers: dict[str, str] | None = None,
    route: str = "/art/v1/lora/update",
) -> tuple[Any, dict, int]:
    """Start `generation()`, publish `update` (a body for `route`: a LoRA update by default;
    or a blocking callable that publishes and returns the response body, run on a thread: a
    streamed full-weight update) once engine 0 has completed `steps` steps more, and let the
    generation finish.

    Returns (the generation's result, the update's response body, the step count `s0` before
    the generation was sent).
    """
    s0 = await engine_steps(client)
    armed = await client.post("/art/v1/test/hold", json={"step": s0 + steps}, headers=headers)
    assert armed.status_code == 200, armed.text
    task = asyncio.create_task(generation())
    try:
        while not (await engine_state(client, headers))["paused"]:
            if task.done():
                await task  # its own error, if any
                pytest.fail(f"the generation ended before engine step {s0 + steps}")
            await asyncio.sleep(0.01)
        try:
            if callable(update):
                body = await asyncio.to_thread(update)
            else:
                upd = await client.post(route, json=update, headers=headers)
                assert upd.status_code == 200, upd.text
                body = upd.json()
        finally:
            resumed = await client.post("/resume", headers=headers)
        assert resumed.status_code == 200, resumed.text
        return await task, body, s0
    finally:
        if not task.done():
            task.cancel()


async def engine_state(client: httpx.AsyncClient, headers: dict[str, str] | None = None) -> dict:
    return (await client.get("/art/v1/engine", headers=headers)).json()


async def update_while_stepping(
    client: httpx.AsyncClient,
    generation: Callable[[], Awaitable[Any]],
    steps: int,
    update: dict,
    headers: dict[str, str] | None = None,
) -> tuple[Any, httpx.Response, int, dict, dict]:
    """Start `generation()` and publish `update` once the engine has completed `steps` steps
    more, *without* holding it: the engine keeps stepping, so the update's stage and commit
    ride its batches (`engine_core/step_rides.py`). The generation must be long enough to
    outlast the update (the caller asserts that it did, from the spans and the ride counts).

    Returns (the generation's result, the update's response, the step count `s0` before the
    generation was sent, `/art/v1/engine` before and after).
    """
    before = await engine_state(client, headers)
    s0 = before["steps"]
    task = asyncio.create_task(generation())
    try:
        while await engine_steps(client) < s0 + steps:
            if task.done():
                await task
                pytest.fail(f"the generation ended before engine step {s0 + steps}")
            await asyncio.sleep(0.005)
        upd = await client.post("/art/v1/lora/update", json=update, headers=headers)
        result = await task
        return result, upd, s0, before, await engine_state(client, headers)
    finally:
        if not task.done():
            task.cancel()
