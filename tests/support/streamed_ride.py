"""An update that rides a running generation, which the test ends once the update settled.

Why: a fixed-length generation with an update sent into it is a bound on the update's
latency in engine steps, not a guarantee: on a busy host a 160-token generation ended before
the update's stage arrived (nothing rode), and the cure of a longer generation costs CPU in
every run. Here the generation is a stream with room to run (`max_tokens` up to the context),
and the test ends it itself (it closes the stream; vLLM aborts the request) only once

1. the update has answered,
2. a chunk of tokens has arrived after the answer was seen, and
3. the caller's `settled(ride)` holds (e.g. every ride of the update has boarded a batch,
   or enough tokens of the new version have arrived), read after each chunk from then on,
   with the engine's figures (`GET /art/v1/engine`) of that moment.

So the interesting case always happens, and the generation is no longer than it needs to be.
Should the generation reach `max_tokens` first, `settled(ride)` is read once more on all of
it, once the update answered (its answer comes back after the batch it rode, so on a busy
host after the generation's last chunk); if it still does not hold, the test fails saying
where it stood.

No hold: the engine keeps stepping while the update is sent (its stage and commit ride the
batches, `engine_core/step_rides.py`). Nothing else may run on the server meanwhile.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import pytest

from art_protocol.provenance import extend_spans


@dataclass
class Ride:
    """What the test saw of a generation an update rode.

    `tokens` and `spans` are the streamed choice's (spans merged as in a whole answer);
    `before` and `after` are `GET /art/v1/engine` before the generation was sent and at the
    moment the test ended it; `s0` is the engine's completed steps before the generation was
    sent (token i of the generation is sampled in step s0 + i + 1 or later)."""

    before: dict
    s0: int
    tokens: list[int] = field(default_factory=list)
    spans: list[dict] = field(default_factory=list)
    update: httpx.Response | None = None
    after: dict | None = None

    @property
    def choice(self) -> dict:
        """The streamed choice, shaped like a whole answer's (for `validate_spans`)."""
        return {"token_ids": self.tokens, "policy_spans": self.spans}

    def rides(self, kind: str = "stepped") -> int:
        """Rides of `kind` ("stepped" or "flushed") since the generation was sent."""
        return self.after["rides"][kind] - self.before["rides"][kind]

    def tokens_of(self, version: int) -> int:
        """Tokens streamed so far whose span carries policy version `version`."""
        return sum(s["end"] - s["start"] for s in self.spans if s["version"] == version)


async def engine_state(client: httpx.AsyncClient, headers: dict[str, str] | None = None) -> dict:
    """`GET /art/v1/engine` on a connection of its own, closed after the answer: between two
    reads the keep-alive connection may idle past the server's keep-alive timeout (5 s), and a
    read sent as the server closes it fails ("Server disconnected without sending a
    response", seen on a busy host)."""
    resp = await client.get("/art/v1/engine", headers={**(headers or {}), "Connection": "close"})
    assert resp.status_code == 200, resp.text
    return resp.json()


async def ride_a_stream(
    client: httpx.AsyncClient,
    body: dict,
    update: dict,
    *,
    tokens_before: int,
    settled: Callable[[Ride], bool],
    route: str = "/v1/completions",
    update_route: str = "/art/v1/lora/update",
    headers: dict[str, str] | None = None,
) -> Ride:
    """Stream `body` (one choice, `return_token_ids` on) to `route`; once `tokens_before` of
    its tokens have arrived, post `update` to `update_route`; end the stream once the update
    answered, a token chunk arrived after that, and `settled(ride)` holds (see the module
    docstring). Returns the `Ride`; the update's response is in `ride.update`."""
    before = await engine_state(client, headers)
    ride = Ride(before=before, s0=before["steps"])
    sent = None  # the update's task
    answer_seen_at = None  # tokens streamed when the test first saw the update's answer
    body = {**body, "stream": True, "return_token_ids": True}
    try:
        async with client.stream("POST", route, json=body, headers=headers) as resp:
            assert resp.status_code == 200, (await resp.aread()).decode()
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                payload = json.loads(line[len("data: ") :])
                if "error" in payload:
                    pytest.fail(f"the ridden generation ended with an error: {payload['error']}")
                fresh = 0
                for choice in payload.get("choices") or ():
                    assert choice["index"] == 0, "one choice per ridden generation"
                    fresh += len(choice.get("token_ids") or ())
                    ride.tokens += choice.get("token_ids") or ()
                    extend_spans(ride.spans, choice.get("policy_spans") or ())
                if sent is None:
                    if len(ride.tokens) >= tokens_before:
                        sent = asyncio.ensure_future(
                            client.post(update_route, json=update, headers=headers)
                        )
                    continue
                if not sent.done() or not fresh:
                    continue
                if answer_seen_at is None:
                    answer_seen_at = len(ride.tokens)
                    ride.update = sent.result()
                    continue
                ride.after = await engine_state(client, headers)
                if settled(ride):
                    return ride  # closing the stream aborts the request
        if sent is not None:
            # The generation reached max_tokens: the update may still have settled in it
            # (its answer comes back after the batch it rode, possibly after the last chunk).
            ride.update = await sent
            ride.after = await engine_state(client, headers)
            if settled(ride):
                return ride
        if sent is None:
            where = "before the update was sent"
        elif answer_seen_at is None:
            where = "before the update answered"
        else:
            where = "before it settled"
        pytest.fail(
            f"the generation ended after {len(ride.tokens)} tokens, {where} "
            f"(max_tokens {body.get('max_tokens')}; spans {ride.spans}; "
            f"update {ride.update and ride.update.text}; engine {ride.after})"
        )
    finally:
        if sent is not None and not sent.done():
            sent.cancel()
