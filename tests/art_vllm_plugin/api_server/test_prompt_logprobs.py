"""Prompt logprobs on a plugin server with `--enable-lora`: answered or refused, never the
engine lost.

vLLM 0.32's CPU build computes prompt logprobs with LoRA enabled through
`PunicaWrapperCPU.add_lora_logits`, which fails (an `einsum` size mismatch) as soon as the
batch holds two requests, and takes EngineCore down with every request on it; the V1 runner
and Model Runner V2 both do. The plugin refuses those requests with 400 naming the reason
where that happens (`art_vllm_plugin/api_server/request_refusals.py`) and serves them where it
works (`test_prompt_logprobs_one_seq.py`: `--max-num-seqs 1`).

The shared plain plugin server (`lora` in tests/support/server_kinds.py, `--enable-lora`):
each request below is one that ends its engine without the refusal (two prompts, or n=2: two
requests in one batch). After each, the server must still serve, and the answer must be a 400
naming the reason or a correct result.
"""

from __future__ import annotations

import httpx
import pytest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from art_vllm_plugin.api_server.request_refusals import asks_prompt_logprobs

PROMPTS = ["the policy model learns from the reward", "a trainer sends new weights"]
MESSAGES = [{"role": "user", "content": PROMPTS[0]}]

CASES = {
    "completions-prompt_logprobs-base": ("/v1/completions", "base", {"prompt_logprobs": 1}),
    "completions-prompt_logprobs-slot": ("/v1/completions", "policy", {"prompt_logprobs": 1}),
    "completions-echo-logprobs-slot": (
        "/v1/completions",
        "policy",
        {"echo": True, "logprobs": 1},
    ),
    "chat-prompt_logprobs-slot": ("/v1/chat/completions", "policy", {"prompt_logprobs": 1}),
    "chat-echo-base": ("/v1/chat/completions", "base", {"echo": True}),
}


def body_for(route: str, model: str, extra: dict) -> dict:
    body = {"model": model, "max_tokens": 3, "return_token_ids": True, **extra}
    if route == "/v1/completions":
        return {"prompt": PROMPTS, "temperature": 0, **body}
    return {"messages": MESSAGES, "n": 2, "temperature": 0.8, "seed": 3, **body}


def check_prompt_logprobs(prompt_token_ids: list[int], prompt_logprobs: list) -> None:
    """A correct result: one entry per prompt token, none for the first, each holding the
    logprob of the prompt's own token."""
    assert len(prompt_logprobs) == len(prompt_token_ids)
    assert prompt_logprobs[0] is None
    for token, entry in zip(prompt_token_ids[1:], prompt_logprobs[1:], strict=True):
        assert str(token) in entry and entry[str(token)]["logprob"] <= 0.0, (token, entry)


def check_answer(route: str, field: str, resp: httpx.Response) -> str:
    """400 naming the reason, or a correct result; returns which."""
    if resp.status_code == 400:
        error = resp.json()["error"]
        assert error["param"] == field, error
        assert "--enable-lora" in error["message"] and "PunicaWrapperCPU" in error["message"]
        assert "Nothing was started" in error["message"]
        return "refused"
    assert resp.status_code == 200, resp.text
    out = resp.json()
    if route == "/v1/completions":
        for choice in out["choices"]:
            check_prompt_logprobs(choice["prompt_token_ids"], choice["prompt_logprobs"])
    else:
        check_prompt_logprobs(out["prompt_token_ids"], out["prompt_logprobs"])
    return "served"


def check_alive(server) -> None:
    assert server.proc.poll() is None, server.log_tail()
    assert httpx.get(server.url + "/health", timeout=60).status_code == 200, server.log_tail()
    body = {"model": "policy", "prompt": PROMPTS, "max_tokens": 2, "temperature": 0}
    resp = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text


@pytest.fixture(scope="module")
def server(lora_server):
    """The shared plain plugin server (`--enable-lora`, several requests per batch)."""
    return lora_server


@pytest.mark.parametrize("case", list(CASES))
def test_prompt_logprobs_never_take_the_engine_down(server, tiny_model, case):
    route, model, extra = CASES[case]
    body = body_for(route, str(tiny_model) if model == "base" else model, extra)
    resp = httpx.post(server.url + route, json=body, timeout=300)
    field = "prompt_logprobs" if "prompt_logprobs" in extra else "echo"
    outcome = check_answer(route, field, resp)
    check_alive(server)
    # This server runs vLLM's CPU build with --enable-lora and batches: where it crashes.
    assert outcome == "refused"


def test_beam_search_with_prompt_logprobs_is_served_as_stock(server):
    """Beam search computes no prompt logprobs (its steps ask for token logprobs only), so a
    beam-search request that names `prompt_logprobs` is served as stock vLLM serves it."""
    body = {
        "model": "policy",
        "prompt": PROMPTS,
        "max_tokens": 3,
        "n": 2,
        "use_beam_search": True,
        "prompt_logprobs": 1,
    }
    resp = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    check_alive(server)


# -- which requests ask for prompt logprobs: the plugin's reading against vLLM's own ---------
COMPLETION_BODIES = [
    {},
    {"prompt_logprobs": 0},
    {"prompt_logprobs": 2},
    {"logprobs": 2},
    {"echo": True},
    {"echo": True, "logprobs": 0},
    {"echo": True, "max_tokens": 0, "logprobs": 1},
]
CHAT_BODIES = [
    {},
    {"prompt_logprobs": 1},
    {"logprobs": True, "top_logprobs": 2},
    {"echo": True},
    {"echo": True, "logprobs": True, "top_logprobs": 3},
]


@pytest.mark.parametrize("extra", COMPLETION_BODIES, ids=str)
def test_completion_requests_that_ask_for_prompt_logprobs(extra):
    request = CompletionRequest.model_validate({"model": "m", "prompt": "x", **extra})
    vllm_computes = request.to_sampling_params(8, {}).prompt_logprobs is not None
    assert (asks_prompt_logprobs(request, "logprobs") is not None) == vllm_computes


@pytest.mark.parametrize("extra", CHAT_BODIES, ids=str)
def test_chat_requests_that_ask_for_prompt_logprobs(extra):
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **extra})
    vllm_computes = request.to_sampling_params(8, {}).prompt_logprobs is not None
    assert (asks_prompt_logprobs(request, "top_logprobs") is not None) == vllm_computes


def test_beam_search_requests_ask_for_none():
    request = CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "use_beam_search": True, "n": 2, "prompt_logprobs": 1}
    )
    assert asks_prompt_logprobs(request, "logprobs") is None
