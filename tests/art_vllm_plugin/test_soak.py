"""Reliability run (bounded): 8 clients while the slot updates every second, 30 times.

Half the clients stream, half do not; they run until the last update answered. Every fifth
update is a bad adapter (NaN), which must be refused. The updates are counted, not timed: on a
slow host they take longer than a second and the run lasts longer, with the same 30 updates
(a run cut at 60 s saw 4 bad updates of the 8 it required on a loaded host). At the end: no
failed request, every choice's spans validate and are non-decreasing, every bad update was
refused, committed versions increased, and the `/art/metrics` counters match what this test
did.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from support.adapters import make_bad_adapters

from art_protocol.client import validate_spans

#: Updates, one per second at most (every fifth one bad), and the clients beside them.
ROUNDS = 30
CLIENTS = 8


@pytest.fixture(scope="module")
def server(lora_server):
    """The shared plain plugin server (`lora` in tests/support/server_kinds.py)."""
    return lora_server


@pytest.fixture(scope="module")
def bad_root(server):
    """Broken adapters, inside the server's allowed adapter roots."""
    return server.scratch


async def _soak(url, adapters, nan_adapter, base):
    """`base`: the slot's version when the soak starts; good updates publish base+1, +2, ..."""
    finished = asyncio.Event()  # the last update answered: the clients stop
    results = {"ok": 0, "failed": [], "choices": []}
    updates = {"good": [], "bad": [], "errors": []}

    async def plain(http, i):
        j = 0
        while not finished.is_set():
            resp = await http.post(
                "/v1/completions",
                json={
                    "model": "policy",
                    "prompt": f"soak {i} {j}",
                    "max_tokens": 32,
                    "n": 1 + i % 2,
                    "temperature": 0.8,
                    "ignore_eos": True,
                },
            )
            j += 1
            if resp.status_code != 200:
                results["failed"].append(resp.text)
                continue
            results["ok"] += 1
            for choice in resp.json()["choices"]:
                results["choices"].append((choice["policy_spans"], 32))

    async def streaming(http, i):
        j = 0
        while not finished.is_set():
            spans: dict[int, list] = {}
            async with http.stream(
                "POST",
                "/v1/completions",
                json={
                    "model": "policy",
                    "prompt": f"stream {i} {j}",
                    "max_tokens": 32,
                    "temperature": 0.8,
                    "ignore_eos": True,
                    "stream": True,
                },
            ) as resp:
                j += 1
                if resp.status_code != 200:
                    results["failed"].append(await resp.aread())
                    continue
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        payload = json.loads(line[6:])
                        if "error" in payload:
                            results["failed"].append(payload)
                        for choice in payload.get("choices") or ():
                            spans.setdefault(choice["index"], []).extend(
                                choice.get("policy_spans") or []
                            )
            results["ok"] += 1
            results["choices"].extend((s, 32) for s in spans.values())

    async def updater(http):
        version, start = base, time.monotonic()
        for k in range(1, ROUNDS + 1):
            await asyncio.sleep(max(0.0, start + k - time.monotonic()))  # at t = 1 s, 2 s, ...
            bad = k % 5 == 0
            path = nan_adapter if bad else adapters[k % 3]
            resp = await http.post(
                "/art/v1/lora/update",
                json={"slot": "policy", "path": str(path), "version": version + 1},
            )
            if bad:
                (updates["bad"] if resp.status_code == 422 else updates["errors"]).append(
                    resp.status_code
                )
            elif resp.status_code == 200:
                version += 1
                updates["good"].append(version)
            else:
                updates["errors"].append(resp.text)
        finished.set()

    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        before = (await http.get("/art/metrics")).json()
        await asyncio.gather(
            *(plain(http, i) for i in range(CLIENTS // 2)),
            *(streaming(http, i) for i in range(CLIENTS // 2)),
            updater(http),
        )
        after = (await http.get("/art/metrics")).json()
    return results, updates, before, after


def test_soak_with_updates_every_second(server, tiny_adapters, bad_root):
    bad = make_bad_adapters(tiny_adapters / "c", bad_root)
    adapters = [tiny_adapters / n for n in ("a", "b", "c")]
    base = server.start_versions["policy"]
    results, updates, before, after = asyncio.run(_soak(server.url, adapters, bad["nan"][0], base))
    assert results["failed"] == []
    assert results["ok"] > 0 and len(results["choices"]) >= results["ok"]
    assert updates["errors"] == []
    assert len(updates["bad"]) == ROUNDS // 5, updates  # every fifth update, each refused
    assert updates["good"] == list(range(base + 1, base + ROUNDS - ROUNDS // 5 + 1))
    seen_versions = set()
    for spans, n in results["choices"]:
        validate_spans({"policy_spans": spans}, n, latest_version=updates["good"][-1])
        versions = [s["version"] for s in spans]
        assert versions == sorted(versions)
        seen_versions.update(versions)
    assert len(seen_versions) > 10, "tokens came from many policy versions"
    assert after["updates_total"] - before["updates_total"] == len(updates["good"])
    assert after["failed_updates_total"] - before["failed_updates_total"] == len(updates["bad"])
    assert after["slots"]["policy"]["version"] == updates["good"][-1]
