"""Spans on streamed answers, on a real `vllm serve`: what the chunks carry, and how a stream
ends when a token has no label.

The shared plain plugin server (`lora` in tests/support/server_kinds.py; ART_TEST_HOOKS=1):
slot `policy` serves adapter a at the version handed over. Nothing here updates a slot.

- A streamed answer's chunks carry spans that concatenate to exactly the spans of the same
  greedy answer asked for whole (completions, a batch of two prompts, and chat), each token
  chunk carrying the spans of its own tokens, and vLLM's chunk bytes are kept as vLLM wrote
  them (non-ASCII text is not re-escaped).
- Labels missing (made to go missing by the test-only label hook,
  `art_vllm_plugin/api_server/label_test_hook.py`: labels only for a request's first K
  tokens): the whole answer is a 500 naming the problem; the streamed answer carries the
  spans of the labelled tokens, then ends with the same error as an error event in vLLM's
  streaming format, then `[DONE]`; no chunk ever carries a made-up version.
"""

from __future__ import annotations

import json
import re
import uuid

import httpx
import pytest

from art_protocol.provenance import extend_spans

PROMPTS = ["the policy model learns from the reward", "a trainer sends new weights"]
LABELLED = 3
ERROR = re.compile(
    r"policy spans (\[.*\]) do not cover the (\d+) completion tokens; "
    r"refusing to report partial provenance"
)


@pytest.fixture(scope="module")
def server(lora_server):
    """The shared plain plugin server: its test hooks make labels go missing on request."""
    return lora_server


@pytest.fixture(scope="module")
def version(server) -> int:
    return server.start_versions["policy"]


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=300)


def stream_events(server, route: str, body: dict) -> list[str]:
    """The raw `data: ...` events of a streamed answer, as the server sent them."""
    events, buffer = [], ""
    with httpx.stream(
        "POST", server.url + route, json={**body, "stream": True}, timeout=300
    ) as resp:
        assert resp.status_code == 200, resp.read()
        for text in resp.iter_text():
            buffer += text
            while "\n\n" in buffer:
                event, buffer = buffer.split("\n\n", 1)
                if event.startswith("data: "):
                    events.append(event[len("data: ") :])
    assert buffer == ""
    return events


def streamed_choices(events: list[str]) -> tuple[dict[int, dict], list[dict]]:
    """{choice index: {"spans": merged spans, "tokens": token ids}} and the error events.

    Each chunk that reports tokens must carry exactly the spans of its own tokens."""
    choices: dict[int, dict] = {}
    errors = []
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        payload = json.loads(event)
        if "error" in payload:
            errors.append(payload["error"])
            continue
        for choice in payload["choices"]:
            got = choices.setdefault(choice["index"], {"spans": [], "tokens": []})
            spans = choice.get("policy_spans") or []
            tokens = choice.get("token_ids") or []
            assert sum(s["end"] - s["start"] for s in spans) == len(tokens), choice
            if spans:
                assert spans[0]["start"] == len(got["tokens"]), (got, choice)
            extend_spans(got["spans"], spans)
            got["tokens"] += tokens
    return choices, errors


def completion_body(model="policy", **extra) -> dict:
    return {
        "model": model,
        "prompt": PROMPTS,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


def chat_body(**extra) -> dict:
    return {
        "model": "policy",
        "messages": [{"role": "user", "content": PROMPTS[0]}],
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


def test_streamed_completion_spans_equal_the_whole_answers_spans(server, version):
    whole = post(server, "/v1/completions", completion_body())
    assert whole.status_code == 200, whole.text
    choices, errors = streamed_choices(stream_events(server, "/v1/completions", completion_body()))
    assert not errors
    assert sorted(choices) == [0, 1]
    for choice in whole.json()["choices"]:
        got = choices[choice["index"]]
        assert got["tokens"] == choice["token_ids"]
        assert got["spans"] == choice["policy_spans"]
        assert choice["policy_spans"] == [
            {"start": 0, "end": 12, "slot": "policy", "version": version}
        ]


def test_streamed_chat_spans_equal_the_whole_answers_spans(server, version):
    whole = post(server, "/v1/chat/completions", chat_body())
    assert whole.status_code == 200, whole.text
    choices, errors = streamed_choices(stream_events(server, "/v1/chat/completions", chat_body()))
    assert not errors
    choice = whole.json()["choices"][0]
    assert choices[0]["tokens"] == choice["token_ids"]
    assert choices[0]["spans"] == choice["policy_spans"]
    assert choice["policy_spans"] == [{"start": 0, "end": 12, "slot": "policy", "version": version}]


def test_streamed_chunks_keep_vllm_bytes(server):
    """The echoed prompt comes back in the first chunk as vLLM wrote it: UTF-8, not escapes."""
    body = {
        "model": "policy",
        "prompt": "h\u00e9llo \u2603 \u4e16\u754c",
        "echo": True,
        "max_tokens": 3,
        "temperature": 0,
    }
    events = stream_events(server, "/v1/completions", body)
    first = json.loads(events[0])["choices"][0]
    assert first["text"].startswith(body["prompt"])
    assert first["policy_spans"][0]["start"] == 0
    assert "\u2603" in events[0] and "\\u2603" not in events[0]


def _marked(labelled: int) -> str:
    return f"art-test-labels-until-{labelled}-{uuid.uuid4().hex}"


@pytest.mark.parametrize(
    ("route", "make_body"),
    [("/v1/completions", completion_body), ("/v1/chat/completions", chat_body)],
    ids=["completions", "chat"],
)
@pytest.mark.parametrize("labelled", [LABELLED, 0])
def test_missing_labels_end_both_answers_with_the_same_error(
    server, version, route, make_body, labelled
):
    body = make_body(max_tokens=8)
    if "prompt" in body:
        body["prompt"] = PROMPTS[0]
    whole = post(server, route, {**body, "request_id": _marked(labelled)})
    assert whole.status_code == 500, whole.text
    error = whole.json()["error"]
    assert error["type"] == "InternalServerError" and error["code"] == 500
    full = ERROR.fullmatch(error["message"])
    assert full and full.group(2) == "8", error

    events = stream_events(server, route, {**body, "request_id": _marked(labelled)})
    choices, errors = streamed_choices(events)
    assert len(errors) == 1 and json.loads(events[-2]) == {"error": errors[0]}, events[-3:]
    assert errors[0]["type"] == "InternalServerError" and errors[0]["code"] == 500
    streamed = ERROR.fullmatch(errors[0]["message"])
    assert streamed, errors[0]
    # The same error: the same labelled spans, for the tokens the stream had reached.
    assert streamed.group(1) == full.group(1)
    assert labelled < int(streamed.group(2)) <= 8
    sent = choices.get(0, {"spans": [], "tokens": []})
    covered = sent["spans"][-1]["end"] if sent["spans"] else 0
    assert covered <= labelled and len(sent["tokens"]) == covered
    assert all(s["version"] == version and s["slot"] == "policy" for s in sent["spans"])
