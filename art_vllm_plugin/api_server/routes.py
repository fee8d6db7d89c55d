"""The `/art/*` HTTP routes."""

from __future__ import annotations

import os

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from art_vllm_plugin import compat, features, plugin_loader
from art_vllm_plugin.api_server.auth import require_api_key
from art_vllm_plugin.api_server.slots import UpdateError
from art_vllm_plugin.version import __version__

router = APIRouter(prefix="/art", dependencies=[Depends(require_api_key)])


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "code": status}})


@router.get("/v1/capabilities")
async def capabilities() -> dict:
    """Plugin and vLLM versions and the plugin features this server has enabled."""
    return {
        "plugin": "art",
        "plugin_version": __version__,
        "api_server": {"pid": os.getpid(), "plugin_active": plugin_loader.is_active()},
        "vllm_version": compat.vllm_version(),
        "supported_vllm": compat.SUPPORTED_RANGE_TEXT,
        "features": features.snapshot(),
        "enabled_features": features.enabled_names(),
    }


@router.get("/v1/engine")
async def engine_state(request: Request) -> dict:
    """EngineCore's view: completed engine steps, per-slot versions (by LoRA id), label."""
    return await compat.call_engine_utility(request.app.state.art.engine_client, "art_slot_state")


@router.get("/v1/slots")
async def slots(request: Request) -> list[dict]:
    return request.app.state.art.slots.list()


def _parse_update(body) -> tuple[str, str, int]:
    if not isinstance(body, dict):
        raise UpdateError(400, 'body must be a JSON object {"slot", "path", "version"}')
    slot, path, version = body.get("slot"), body.get("path"), body.get("version")
    if not isinstance(slot, str) or not slot:
        raise UpdateError(400, f"'slot' must be a non-empty string, got {slot!r}")
    if not isinstance(path, str) or not path:
        raise UpdateError(400, f"'path' must be a non-empty string, got {path!r}")
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise UpdateError(400, f"'version' must be a non-negative integer, got {version!r}")
    return slot, path, version


@router.post("/v1/lora/update")
async def lora_update(request: Request):
    """Write a new adapter into a slot between two engine steps and bump its version."""
    try:
        try:
            body = await request.json()
        except ValueError as exc:
            raise UpdateError(400, f"body is not valid JSON: {exc}") from exc
        slot, path, version = _parse_update(body)
    except UpdateError as exc:
        request.app.state.art.slots.failed_unattributed += 1
        return _error(exc.status, exc.message)
    try:
        return await request.app.state.art.slots.update(slot, path, version)
    except UpdateError as exc:
        return _error(exc.status, exc.message)


@router.post("/v1/test/fault")
async def test_fault(request: Request):
    """Test-only fault hook (404 unless the server runs with ART_TEST_HOOKS=1).

    Body `{"kind": "commit", "rank": R}`: the next update's commit fails on worker rank R
    after writing its weights, to exercise the all-or-nothing restore.
    """
    if os.environ.get("ART_TEST_HOOKS") != "1":
        return _error(404, "Not Found")
    body = await request.json()
    kind, rank = body.get("kind"), body.get("rank")
    if kind != "commit" or not isinstance(rank, int):
        return _error(400, 'body must be {"kind": "commit", "rank": <int>}')
    await compat.call_engine_utility(
        request.app.state.art.engine_client, "art_test_inject_fault", kind, rank
    )
    return {"armed": {"kind": kind, "rank": rank}}
