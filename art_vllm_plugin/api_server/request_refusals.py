"""Requests refused before they start, because serving them would take the engine down.

Prompt logprobs with `--enable-lora` on the CPU build: vLLM 0.32 computes them through the CPU
LoRA logits kernel, which fails as soon as the batch holds two requests or more and ends
EngineCore with every request on it (the reason in full: `compat.api_server.
cpu_lora_logits_fail_on_batches`). Both model runners (V1 and Model Runner V2) go through it.
Every plugin server that takes updates runs with `--enable-lora`, so one such request would
end every rollout on the server. It is refused with 400 naming the reason, before anything
runs; where it works (no `--enable-lora`, `--max-num-seqs 1`, GPUs) it is served as stock
vLLM serves it.

Which requests ask for prompt logprobs mirrors vLLM 0.32's `to_sampling_params`
(`entrypoints/openai/{completion,chat_completion}/protocol.py`): `prompt_logprobs`, or `echo`
with the request's `logprobs` (completions) / `top_logprobs` (chat, 0 by default, so any chat
`echo`). Beam search computes none (its step requests ask for token logprobs only).
"""

from __future__ import annotations

import functools

from art_vllm_plugin.compat.api_server import cpu_lora_logits_fail_on_batches, error_response


def asks_prompt_logprobs(request, echo_logprobs_field: str) -> str | None:
    """The request field that makes vLLM compute prompt logprobs, or None."""
    if getattr(request, "use_beam_search", False):
        return None
    if getattr(request, "prompt_logprobs", None) is not None:
        return "prompt_logprobs"
    if getattr(request, "echo", False) and getattr(request, echo_logprobs_field, None) is not None:
        return "echo"
    return None


def refusal_message(field: str) -> str:
    asked = (
        "`prompt_logprobs`"
        if field == "prompt_logprobs"
        else "`echo` (which asks for prompt logprobs)"
    )
    return (
        f"{asked} is refused on this server: with --enable-lora on vLLM's CPU build, prompt "
        "logprobs go through the CPU LoRA logits kernel (PunicaWrapperCPU.add_lora_logits), "
        "which fails whenever the batch holds two requests or more and takes the engine down "
        "with every running request. Nothing was started. Ask a server without --enable-lora, "
        "or one started with --max-num-seqs 1, for prompt logprobs"
    )


def _refuse_prompt_logprobs(echo_logprobs_field: str):
    def wrap(create):
        @functools.wraps(create)
        async def create_guarded(self, request, raw_request=None):
            field = asks_prompt_logprobs(request, echo_logprobs_field)
            if field is not None and cpu_lora_logits_fail_on_batches(
                self.engine_client.vllm_config
            ):
                return error_response(refusal_message(field), "BadRequestError", 400, field)
            return await create(self, request, raw_request)

        return create_guarded

    return wrap


#: Wrapper for `OpenAIServingCompletion.create_completion`.
refuse_completion_prompt_logprobs = _refuse_prompt_logprobs("logprobs")
#: Wrapper for `OpenAIServingChat.create_chat_completion`.
refuse_chat_prompt_logprobs = _refuse_prompt_logprobs("top_logprobs")
