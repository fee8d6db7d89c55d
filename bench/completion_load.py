"""The generation load the serving benchmarks share: concurrent clients of sampled completions.

Run as part of a `python bench/<name>.py` script (this folder is then on `sys.path`).
"""

from __future__ import annotations

import asyncio
import time

import httpx


async def generate_until(
    http: httpx.AsyncClient,
    stop_at: float,
    clients: int,
    prompt: str,
    *,
    max_tokens: int = 64,
    model: str = "policy",
) -> int:
    """`clients` loops of sampled completions (`ignore_eos`, distinct prompts) until the
    monotonic time `stop_at`; returns the completion tokens generated."""
    counts = [0] * clients

    async def client(i: int) -> None:
        j = 0
        while time.monotonic() < stop_at:
            resp = await http.post(
                "/v1/completions",
                json={
                    "model": model,
                    "prompt": f"{prompt} {i} {j}",
                    "max_tokens": max_tokens,
                    "temperature": 0.8,
                    "ignore_eos": True,
                },
            )
            resp.raise_for_status()
            counts[i] += resp.json()["usage"]["completion_tokens"]
            j += 1

    await asyncio.gather(*(client(i) for i in range(clients)))
    return sum(counts)
