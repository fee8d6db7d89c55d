"""Prompt logprobs stay served where they work: `--enable-lora --max-num-seqs 1` on the CPU
build.

With one request per batch, the CPU LoRA logits kernel's single index covers every prompt
row, so vLLM computes prompt logprobs right (the failure needs two requests in a batch:
`test_prompt_logprobs.py`). The plugin must not refuse them here: the same requests that are
refused on the plain server are answered, correctly, and the server keeps serving.

The shared `one_seq` server (tests/support/server_kinds.py): `--max-num-seqs 1`, one LoRA
slot on the device.
"""

from __future__ import annotations

import httpx
import pytest

PROMPTS = ["the policy model learns from the reward", "a trainer sends new weights"]
#: The requests `test_prompt_logprobs.py` sends to the plain server (route, model, fields).
CASES = {
    "completions-prompt_logprobs-base": ("/v1/completions", "base", {"prompt_logprobs": 1}),
    "completions-prompt_logprobs-slot": ("/v1/completions", "policy", {"prompt_logprobs": 1}),
    "completions-echo-logprobs-slot": ("/v1/completions", "policy", {"echo": True, "logprobs": 1}),
    "chat-prompt_logprobs-slot": ("/v1/chat/completions", "policy", {"prompt_logprobs": 1}),
    "chat-echo-base": ("/v1/chat/completions", "base", {"echo": True}),
}


def body_for(route: str, model: str, extra: dict) -> dict:
    body = {"model": model, "max_tokens": 3, "return_token_ids": True, **extra}
    if route == "/v1/completions":
        return {"prompt": PROMPTS, "temperature": 0, **body}
    messages = [{"role": "user", "content": PROMPTS[0]}]
    return {"messages": messages, "n": 2, "temperature": 0.8, "seed": 3, **body}


def check_prompt_logprobs(prompt_token_ids: list[int], prompt_logprobs: list) -> None:
    """One entry per prompt token, none for the first, each with the prompt's own token."""
    assert len(prompt_logprobs) == len(prompt_token_ids)
    assert prompt_logprobs[0] is None
    for token, entry in zip(prompt_token_ids[1:], prompt_logprobs[1:], strict=True):
        assert str(token) in entry and entry[str(token)]["logprob"] <= 0.0, (token, entry)


def check_served(route: str, resp: httpx.Response) -> None:
    assert resp.status_code == 200, resp.text
    out = resp.json()
    if route == "/v1/completions":
        for choice in out["choices"]:
            check_prompt_logprobs(choice["prompt_token_ids"], choice["prompt_logprobs"])
    else:
        check_prompt_logprobs(out["prompt_token_ids"], out["prompt_logprobs"])


def check_alive(server) -> None:
    assert server.proc.poll() is None, server.log_tail()
    assert httpx.get(server.url + "/health", timeout=60).status_code == 200, server.log_tail()


@pytest.fixture(scope="module")
def server(one_seq_server):
    """The shared `one_seq` server: one request per batch, LoRA enabled."""
    return one_seq_server


@pytest.mark.parametrize("case", list(CASES))
def test_prompt_logprobs_are_served_with_one_request_per_batch(server, tiny_model, case):
    route, model, extra = CASES[case]
    body = body_for(route, str(tiny_model) if model == "base" else model, extra)
    resp = httpx.post(server.url + route, json=body, timeout=300)
    check_served(route, resp)
    check_alive(server)


def test_a_batch_gives_each_prompt_its_own_prompt_logprobs(server):
    """Two prompts in one request equal each prompt asked alone, and the slot's adapter
    changes them (the LoRA logits are applied, not skipped)."""

    def prompt_logprobs(model: str, prompts: list[str]) -> list[list]:
        body = {
            "model": model,
            "prompt": prompts,
            "max_tokens": 1,
            "temperature": 0,
            "prompt_logprobs": 0,
            "return_token_ids": True,
        }
        resp = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
        assert resp.status_code == 200, resp.text
        return [c["prompt_logprobs"] for c in resp.json()["choices"]]

    both = prompt_logprobs("policy", PROMPTS)
    assert both == [prompt_logprobs("policy", [p])[0] for p in PROMPTS]
    assert prompt_logprobs("other", PROMPTS) != both, "slot `other` serves another adapter"
