"""Greedy completion tokens: how the serve tests tell which adapter a server serves.

Two models with the same weights give the same greedy tokens for a prompt; a test compares a
slot's tokens with a reference slot's started from a known adapter, on the same server."""

from __future__ import annotations

import httpx

PROMPT = "the policy model learns from the reward and the trainer sends"


def greedy_tokens(url: str, model: str = "policy", max_tokens: int = 8) -> list[int]:
    """The token ids of a greedy completion of `PROMPT` by `model` (`ignore_eos`: always
    `max_tokens` of them); fails the test on any status but 200."""
    resp = httpx.post(
        url + "/v1/completions",
        json={
            "model": model,
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
        timeout=300,
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]
