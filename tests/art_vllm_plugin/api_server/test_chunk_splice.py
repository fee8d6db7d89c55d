"""The span splice on streamed chunks, on chunks written exactly as vLLM 0.32 writes them.

No server: each chunk is built with vLLM's own response models and serialised the way its
completion and chat stream generators do (`f"data: {m.model_dump_json(exclude_unset=True)}\\n\\n"`,
errors as `create_streaming_error_response`), so a vLLM that changes its chunk layout fails
here first. The splice must leave every byte of vLLM's chunk as it was, add exactly one
field to the choice that reports tokens, and leave everything else alone: `[DONE]`, error
events, usage chunks, chat's role and echo chunks, keep-alive comments.
"""

from __future__ import annotations

import json
from http import HTTPStatus

import pytest
from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
)
from vllm.entrypoints.openai.completion.protocol import (
    CompletionLogProbs,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from vllm.entrypoints.serve import create_error_response
from vllm.entrypoints.serve.engine.protocol import UsageInfo

from art_vllm_plugin.api_server import chunk_splice

SPANS = [
    {"start": 3, "end": 4, "slot": "pölicy", "version": 7},
    {"start": 4, "end": 5, "slot": "pölicy", "version": 8},
]
UNICODE = 'h\u00e9llo \u2603 \u4e16\u754c "quoted" \\ back\\"slash\n\U0001f600'


def _sse(model) -> str:
    return f"data: {model.model_dump_json(exclude_unset=True)}\n\n"


def completion_chunk(index=0, text=UNICODE, finish=None, token_ids=None, logprobs=None, **kw):
    """As `completion_stream_generator` builds an output chunk."""
    return _sse(
        CompletionStreamResponse(
            id="cmpl-1",
            object="text_completion",
            created=1,
            model=kw.get("model", "policy"),
            choices=[
                CompletionResponseStreamChoice(
                    index=index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=finish,
                    stop_reason=None,
                    prompt_token_ids=kw.get("prompt_token_ids"),
                    token_ids=token_ids,
                )
            ],
        )
    )


def chat_chunk(index=0, delta=None, finish=None, token_ids=None, logprobs=None):
    """As `chat_completion_stream_generator` builds an output chunk."""
    return _sse(
        ChatCompletionStreamResponse(
            id="chatcmpl-1",
            object="chat.completion.chunk",
            created=1,
            choices=[
                ChatCompletionResponseStreamChoice(
                    index=index,
                    delta=delta if delta is not None else DeltaMessage(content=UNICODE),
                    logprobs=logprobs,
                    finish_reason=finish,
                    token_ids=token_ids,
                )
            ],
            model="policy",
        )
    )


def chat_role_chunk(index=0, prompt_token_ids=None):
    return _sse(
        ChatCompletionStreamResponse(
            id="chatcmpl-1",
            object="chat.completion.chunk",
            created=1,
            choices=[
                ChatCompletionResponseStreamChoice(
                    index=index,
                    delta=DeltaMessage(role="assistant", content=""),
                    logprobs=None,
                    finish_reason=None,
                )
            ],
            model="policy",
            prompt_token_ids=prompt_token_ids,
        )
    )


def chat_echo_chunk(index=0):
    return _sse(
        ChatCompletionStreamResponse(
            id="chatcmpl-1",
            object="chat.completion.chunk",
            created=1,
            choices=[
                ChatCompletionResponseStreamChoice(
                    index=index,
                    delta=DeltaMessage(content='echo "token_ids": \u2603'),
                    logprobs=None,
                    finish_reason=None,
                )
            ],
            model="policy",
        )
    )


def usage_chunk():
    usage = UsageInfo(prompt_tokens=3, completion_tokens=5, total_tokens=8)
    chunk = CompletionStreamResponse(
        id="cmpl-1", created=1, model="policy", choices=[], usage=usage
    )
    return f"data: {chunk.model_dump_json(exclude_unset=False, exclude_none=True)}\n\n"


def error_event(message='policy spans [] do not cover "the" 4 tokens \u2603'):
    body = create_error_response(
        message, err_type="InternalServerError", status_code=HTTPStatus.INTERNAL_SERVER_ERROR
    )
    return f"data: {json.dumps(body.model_dump())}\n\n"


def _spliced_ok(chunk: str, index: int) -> str:
    found = chunk_splice.token_chunk(chunk)
    assert found is not None and found.index == index, chunk
    out = chunk_splice.splice(chunk, found.at, SPANS)
    inserted = ',"policy_spans":' + chunk_splice.spans_json(SPANS)
    # vLLM's bytes are untouched: removing the one inserted field gives the chunk back.
    assert out.replace(inserted, "", 1) == chunk
    assert out.startswith("data: {") and out.endswith("}\n\n")
    before = json.loads(chunk[len("data: ") :])
    after = json.loads(out[len("data: ") :])
    assert after["choices"][0].pop("policy_spans") == SPANS
    assert after == before
    return out


def test_completion_chunk_with_unicode_keeps_vllm_bytes():
    chunk = completion_chunk()
    out = _spliced_ok(chunk, 0)
    assert "\u2603" in out and "\\u2603" not in out, "non-ASCII text stays as vLLM wrote it"
    assert '"choices":[{"index":0,"policy_spans":[' in out


def test_completion_chunk_of_a_later_prompt_and_choice():
    """Index 13 (prompt 6 of n=2, choice 1), token ids, prompt token ids, and logprobs whose
    keys are token texts that look like the fields the splice looks for."""
    logprobs = CompletionLogProbs(
        text_offset=[0],
        token_logprobs=[-0.5],
        tokens=['"token_ids":'],
        top_logprobs=[{'"token_ids":': -0.5, "token_ids": -1.0, '"choices":[{"index":9': -2}],
    )
    chunk = completion_chunk(
        index=13, token_ids=[5, 6], prompt_token_ids=[1, 2, 3], logprobs=logprobs
    )
    _spliced_ok(chunk, 13)


def test_completion_finish_chunk_and_a_model_name_that_looks_like_a_choice():
    chunk = completion_chunk(
        index=2, text="", finish="length", model='m"choices":[{"index":7,"token_ids":'
    )
    _spliced_ok(chunk, 2)


def test_chat_content_and_finish_chunks():
    _spliced_ok(chat_chunk(index=1), 1)
    _spliced_ok(chat_chunk(index=0, delta=DeltaMessage(), finish="stop", token_ids=[9]), 0)
    logprobs = ChatCompletionLogProbs(
        content=[
            ChatCompletionLogProbsContent(
                token="\u2603",
                logprob=-0.1,
                bytes=[226, 152, 131],
                top_logprobs=[ChatCompletionLogProb(token='"token_ids":', logprob=-3.0)],
            )
        ]
    )
    _spliced_ok(chat_chunk(index=3, logprobs=logprobs), 3)


@pytest.mark.parametrize(
    "chunk",
    [
        chat_role_chunk(),
        chat_role_chunk(index=1, prompt_token_ids=[1, 2, 3]),
        chat_echo_chunk(),
        usage_chunk(),
        error_event(),
        "data: [DONE]\n\n",
        ": keep-alive\n\n",
    ],
    ids=["role", "role-with-prompt-ids", "echo", "usage", "error", "done", "keep-alive"],
)
def test_chunks_without_tokens_are_left_alone(chunk):
    assert chunk_splice.token_chunk(chunk) is None


def test_done_and_error_events_are_recognised():
    assert chunk_splice.is_done("data: [DONE]\n\n")
    assert not chunk_splice.is_done(completion_chunk(text="data: [DONE]"))
    assert chunk_splice.is_error(error_event())
    assert not chunk_splice.is_error(completion_chunk(text='{"error": 1}'))
    assert not chunk_splice.is_error("data: [DONE]\n\n")
