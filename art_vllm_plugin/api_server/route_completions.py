"""`POST /art/v1/completions` and `/art/v1/chat/completions` with `"return_routes": true`.

The body is the usual OpenAI request plus `return_routes` (bool) and `routes_prompt_start`
(int >= 0: skip that many prompt rows, for a client that holds the earlier turns' routes; it
is vLLM's `routed_experts_prompt_start`). The answer is one `application/vnd.art.routes` body
(`art_protocol.routed_completion`): the completion JSON exactly as `/v1/...` builds it (with
`policy_spans`, plus `route_spans` and `routes: {rows, prompt_start}` per choice; never route
arrays) followed by the route bundle, choice i = trajectory i.

How the rows get here: the request runs through vLLM's own serving object, unchanged. While
it runs, a context variable asks our wrappers of the two response builders to take each final
`CompletionOutput.routed_experts` (filled natively or by the plugin's worker hook) off the
output before vLLM would base64 it into the JSON, and keep it for the bundle. The stock
`/v1/*` routes are untouched (they keep vLLM's base64 `.npy` field).

Refused: `stream: true` with routes (400; not specified yet), a server without
`--art-routes` (400), and a body over the size limit (413, naming the limit).
"""

from __future__ import annotations

import contextvars
import functools
from dataclasses import dataclass, field
from http import HTTPStatus

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from art_protocol.routed_completion import MEDIA_TYPE, encode_head
from art_vllm_plugin import compat
from art_vllm_plugin.api_server.auth import require_api_key
from art_vllm_plugin.routes import config as routes_config
from art_vllm_plugin.routes.spans import expected_rows, route_spans

router = APIRouter(prefix="/art", dependencies=[Depends(require_api_key)])


@dataclass
class _Sink:
    """Final routed-experts arrays of one request, with their prompt lengths."""

    completion: list[tuple[np.ndarray | None, int, int]] = field(default_factory=list)
    chat: dict[int, tuple[np.ndarray | None, int, int]] = field(default_factory=dict)


_SINK: contextvars.ContextVar[_Sink | None] = contextvars.ContextVar("art_routes", default=None)


def _take(output) -> np.ndarray | None:
    routes = output.routed_experts
    output.routed_experts = None  # vLLM would base64 it into the JSON
    return routes


def _entry(res, out) -> tuple[np.ndarray | None, int, int]:
    """(routes, prompt tokens, completion tokens) of one final output."""
    return _take(out), len(res.prompt_token_ids or ()), len(out.token_ids)


def take_routes_from_completion(original):
    """Wrapper for `request_output_to_completion_response` (applied by `install`)."""

    @functools.wraps(original)
    def request_output_to_completion_response(self, final_res_batch, *args, **kwargs):
        sink = _SINK.get()
        if sink is not None:
            for res in final_res_batch:
                for out in res.outputs:
                    sink.completion.append(_entry(res, out))
        return original(self, final_res_batch, *args, **kwargs)

    return request_output_to_completion_response


def take_routes_from_chat(original):
    """Wrapper for `chat_completion_full_generator` (applied by `install`)."""

    @functools.wraps(original)
    async def chat_completion_full_generator(self, request, result_generator, *args, **kwargs):
        sink = _SINK.get()
        if sink is None:
            return await original(self, request, result_generator, *args, **kwargs)

        async def tap():
            async for res in result_generator:
                for out in res.outputs:
                    if out.routed_experts is not None or out.finish_reason is not None:
                        sink.chat[out.index] = _entry(res, out)
                yield res

        return await original(self, request, tap(), *args, **kwargs)

    return chat_completion_full_generator


def capture_mode(vllm_config) -> str | None:
    """'worker', 'native', or None (routes off)."""
    if not vllm_config.aux_output_config.enabled:
        return None
    return "worker" if compat.routes_use_worker_path(vllm_config) else "native"


class RoutedResponse(Response):
    """The body in two writes, head (header + JSON) then the bundle buffer as is: the
    routes are copied once (into the bundle), not again into one body buffer."""

    def __init__(self, head: bytes, bundle: bytearray) -> None:
        super().__init__(content=b"", media_type=MEDIA_TYPE)
        self.head, self.bundle = head, bundle
        self.headers["content-length"] = str(len(head) + len(bundle))

    async def __call__(self, scope, receive, send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        await send({"type": "http.response.body", "body": self.head, "more_body": True})
        await send({"type": "http.response.body", "body": memoryview(self.bundle)})


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "code": status}})


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _parse(body) -> tuple[dict, bool, int]:
    if not isinstance(body, dict):
        raise _Refused(400, "body must be a JSON object")
    body = dict(body)
    want = body.pop("return_routes", False)
    if not isinstance(want, bool):
        raise _Refused(400, f"'return_routes' must be true or false, got {want!r}")
    start = body.pop("routes_prompt_start", None)
    native = body.get("routed_experts_prompt_start")
    if start is not None and native is not None and start != native:
        raise _Refused(400, "give 'routes_prompt_start' or 'routed_experts_prompt_start', not both")
    start = native if start is None else start
    start = 0 if start is None else start
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        raise _Refused(400, f"'routes_prompt_start' must be an integer >= 0, got {start!r}")
    if want:
        body["routed_experts_prompt_start"] = start
        if body.get("stream"):
            raise _Refused(
                400, "'stream': true cannot be combined with 'return_routes' (not specified yet)"
            )
    return body, want, start


def _layers_topk(vllm_config, routes: list[np.ndarray | None]) -> tuple[int, int]:
    for array in routes:
        if array is not None:
            return array.shape[1], array.shape[2]
    text = vllm_config.model_config.hf_text_config
    dense = len(getattr(text, "mlp_only_layers", ()) or ())
    return text.num_hidden_layers - dense, vllm_config.model_config.get_num_experts_per_tok()


def _routed_body(response, vllm_config, captured: list[tuple[np.ndarray | None, int, int]], start):
    from art_protocol.route_bundle import encode_route_bundle

    completion = response.model_dump()
    choices = completion.get("choices", [])
    if len(captured) != len(choices):
        raise RuntimeError(f"{len(captured)} route arrays for {len(choices)} choices")
    layers, topk = _layers_topk(vllm_config, [entry[0] for entry in captured])
    arrays = []
    for choice, (routes, prompt_len, completion_len) in zip(choices, captured, strict=True):
        choice.pop("routed_experts", None)
        if routes is None:
            routes = np.zeros((0, layers, topk), dtype=np.uint8)
        rows = routes.shape[0]
        want = expected_rows(prompt_len, completion_len, start)
        if rows != want:
            raise RuntimeError(
                f"choice {choice.get('index')}: {rows} route rows, expected {want} "
                f"(prompt {prompt_len}, completion {completion_len}, prompt_start {start})"
            )
        choice["route_spans"] = route_spans(
            choice.get("policy_spans") or [], prompt_len, start, rows
        )
        choice["routes"] = {"rows": rows, "prompt_start": start, "prompt_tokens": prompt_len}
        arrays.append(routes)
    bundle = encode_route_bundle(
        arrays, num_experts=compat.num_experts(vllm_config), num_layers=layers, topk=topk
    )
    return encode_head(completion, len(bundle)), bundle


async def _serve(raw_request: Request, chat: bool):
    try:
        try:
            body = await raw_request.json()
        except ValueError as exc:
            raise _Refused(400, f"body is not valid JSON: {exc}") from exc
        body, want, start = _parse(body)
        engine_client = raw_request.app.state.art.engine_client
        vllm_config = engine_client.vllm_config
        if want and capture_mode(vllm_config) is None:
            raise _Refused(400, "'return_routes' needs a server started with --art-routes")
        request_cls = compat.chat_request_class() if chat else compat.completion_request_class()
        try:
            request = request_cls.model_validate(body)
        except ValueError as exc:
            raise _Refused(400, f"invalid request: {exc}") from exc
    except _Refused as exc:
        return _error(exc.status, exc.message)
    completion_handler, chat_handler = compat.serving_handlers(raw_request.app.state)
    handler = chat_handler if chat else completion_handler
    if handler is None:
        return _error(404, f"this server has no {'chat ' if chat else ''}completions API")
    sink = _Sink()
    token = _SINK.set(sink)
    try:
        if chat:
            response = await handler.create_chat_completion(request, raw_request)
        else:
            response = await handler.create_completion(request, raw_request)
    finally:
        _SINK.reset(token)
    if not hasattr(response, "choices"):  # an ErrorResponse (or a stream, refused above)
        error = getattr(response, "error", None)
        status = getattr(error, "code", HTTPStatus.INTERNAL_SERVER_ERROR)
        return JSONResponse(content=response.model_dump(), status_code=int(status))
    if not want:
        content = response.model_dump()
        for choice in content.get("choices", []):
            choice.pop("routed_experts", None)
        return JSONResponse(content=content)
    captured = (
        [sink.chat.get(c.index, (None, 0, 0)) for c in response.choices]
        if chat
        else sink.completion
    )
    head, bundle = _routed_body(response, vllm_config, captured, start)
    size, limit = len(head) + len(bundle), routes_config.max_body_bytes()
    if size > limit:
        return _error(
            413,
            f"the routed response would be {size} bytes, over this server's limit "
            f"of {limit} bytes ({routes_config.MAX_BYTES_ENV}); ask for fewer tokens or choices",
        )
    return RoutedResponse(head, bundle)


@router.post("/v1/completions")
async def completions(raw_request: Request):
    return await _serve(raw_request, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(raw_request: Request):
    return await _serve(raw_request, chat=True)
