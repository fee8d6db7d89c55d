"""Policy spans on beam-search answers (`use_beam_search`, completions and chat).

Why: vLLM assembles a beam-search answer itself (`BeamSearchOnlineMixin.beam_search`, vLLM
0.32 `entrypoints/generate/beam_search/online.py`): its final `RequestOutput` has no
`weight_versions` and no `lora_request`, so the response spans could not cover the tokens and
the request failed with a 500 that stock vLLM never gives.

Underneath, beam search is ordinary engine requests: at each step, one request per live beam,
whose prompt is the original prompt plus the beam's tokens so far, asking for one token with
logprobs. The beam's token at position j comes from the logprobs of the request whose prompt
ended with the beam's first j tokens, so its version is that request's label, exactly. We
record each request's label (`record_step_labels`, around the beam-search module's own
`collect_from_async_generator`, which gathers each request's outputs) and, when the answer is
assembled, give each beam `weight_versions` from the labels of its positions and the
`lora_request` it ran with (`spans_on_beams`). The ordinary span code then reports them.

Which beam search a request belongs to travels in a context variable: beam search creates its
step requests as asyncio tasks, which copy the context of the code that creates them. The
variable is set only while the wrapped generator runs and reset before it yields, so it never
leaks into the caller's context.

Memory: a step whose requests all carry one label (almost always: they are submitted together)
keeps just that label; only a step that an update split keeps a label per beam prefix.
"""

from __future__ import annotations

import contextvars
import functools
import inspect

from art_vllm_plugin.compat.api_server import weight_version_span

_MISSING = object()


class BeamLabels:
    """The labels of one beam search's engine requests, by beam position."""

    def __init__(self, prompt_len: int):
        self.prompt_len = prompt_len
        self._open: dict[int, dict[tuple[int, ...], str | None]] = {}
        self._closed: dict[int, object] = {}  # position -> label, or {prefix: label}

    def record(self, prompt_token_ids, label: str | None) -> None:
        """One engine request: its prompt (original prompt + a beam's first j tokens) and the
        label of the step that sampled its token (None when it reported none)."""
        prefix = tuple(prompt_token_ids[self.prompt_len :])
        position = len(prefix)
        self._open.setdefault(position, {})[prefix] = label
        for earlier in [p for p in self._open if p < position]:
            self._close(earlier)

    def _close(self, position: int) -> None:
        by_prefix = self._open.pop(position)
        labels = set(by_prefix.values())
        self._closed[position] = next(iter(labels)) if len(labels) == 1 else by_prefix

    def weight_versions(self, token_ids) -> list | None:
        """vLLM `WeightVersionSpan`s over a beam's tokens: one per run of equal labels. A
        position without a recorded label ends them (the span check then refuses the answer
        as for any output whose labels do not cover its tokens)."""
        for position in list(self._open):
            self._close(position)
        tokens = list(token_ids)
        spans: list = []
        for j in range(len(tokens)):
            label = self._closed.get(j, _MISSING)
            if isinstance(label, dict):
                label = label.get(tuple(tokens[:j]), _MISSING)
            if label is _MISSING or label is None:
                break
            if spans and spans[-1][0] == label:
                spans[-1][2] = j + 1
            else:
                spans.append([label, j, j + 1])
        if not spans and tokens:
            return None
        return [weight_version_span(label, start, end) for label, start, end in spans]


_CURRENT: contextvars.ContextVar[BeamLabels | None] = contextvars.ContextVar(
    "art_beam_labels", default=None
)


def _label_of(result) -> str | None:
    """The label of a one-token request's output (its only span)."""
    spans = result.outputs[0].weight_versions if result.outputs else None
    return spans[-1].version if spans else None


def record_step_labels(original):
    """Wrapper for the beam-search module's `collect_from_async_generator`: inside a beam
    search, record the label of each step request it collects."""

    @functools.wraps(original)
    async def collect(iterator):
        items = await original(iterator)
        labels = _CURRENT.get()
        if labels is not None and items:
            last = items[-1]
            labels.record(last.prompt_token_ids or (), _label_of(last))
        return items

    return collect


def _decoder_prompt_len(prompt) -> int:
    """How many tokens the prompt has (vLLM's `tokenized_length`: the decoder prompt's)."""
    decoder = prompt["decoder_prompt"] if prompt.get("type") == "enc_dec" else prompt
    return len(decoder.get("prompt_token_ids") or ())


def spans_on_beams(original):
    """Wrapper for `BeamSearchOnlineMixin.beam_search`: each beam of the answer gets the
    labels of the requests that made its tokens, and the answer its `lora_request`."""
    sig = inspect.signature(original)

    @functools.wraps(original)
    async def beam_search(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        bound.apply_defaults()
        lora_request = bound.arguments["lora_request"]
        labels = BeamLabels(_decoder_prompt_len(bound.arguments["prompt"]))
        results = original(*bound.args, **bound.kwargs)
        try:
            while True:
                token = _CURRENT.set(labels)
                try:
                    result = await anext(results)
                except StopAsyncIteration:
                    return
                finally:
                    _CURRENT.reset(token)
                for output in result.outputs:
                    if output.weight_versions is None:
                        output.weight_versions = labels.weight_versions(output.token_ids)
                if result.lora_request is None:
                    result.lora_request = lora_request
                yield result
        finally:
            await results.aclose()

    return beam_search
