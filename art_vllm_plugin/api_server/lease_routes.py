"""The `/art/v1/leases` routes (exact leases, `api_server/leases.py`).

Included into the `/art` router (`api_server/routes.py`), so the API-key guard applies to them
like to every other `/art/*` route.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from art_vllm_plugin.api_server import leases

router = APIRouter()


def _error(exc: leases.LeaseError) -> JSONResponse:
    return JSONResponse(
        status_code=exc.status,
        content={"error": {"message": exc.message, "code": exc.status, **exc.extra}},
    )


@router.post("/v1/leases")
async def create_lease(request: Request):
    """Pin version N of a slot as `slot@N` for `ttl_s` seconds."""
    try:
        try:
            body = await request.json()
        except ValueError as exc:
            raise leases.LeaseError(400, f"body is not valid JSON: {exc}") from exc
        slot, version, ttl_s = leases.parse_body(body)
        return await request.app.state.art.leases.create(slot, version, ttl_s)
    except leases.LeaseError as exc:
        return _error(exc)


@router.get("/v1/leases")
async def list_leases(request: Request) -> list[dict]:
    """Every API server's leases, as engine 0's registry has them now."""
    art = request.app.state.art
    return leases.leases_of(await art.leases.book())


@router.delete("/v1/leases/{lease_id}")
async def release_lease(lease_id: str, request: Request):
    try:
        return await request.app.state.art.leases.release(lease_id)
    except leases.LeaseError as exc:
        return _error(exc)
