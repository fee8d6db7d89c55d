"""The `/art/*` HTTP routes."""

from __future__ import annotations

import os

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from art_protocol.adapter_stream import is_adapter_stream, parse_adapter_stream
from art_protocol.updates import UpdateRequestError
from art_protocol.weight_updates import is_transfer, parse_transfer_update, parse_weights_update
from art_vllm_plugin import compat, features, install
from art_vllm_plugin.api_server import adapter_push, commit_lags, expert_cut, lease_routes, leases
from art_vllm_plugin.api_server.auth import require_api_key
from art_vllm_plugin.api_server.update_coordinator import UpdateError, parse_update
from art_vllm_plugin.version import __version__

router = APIRouter(prefix="/art", dependencies=[Depends(require_api_key)])


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "code": status}})


@router.get("/v1/capabilities")
async def capabilities(request: Request) -> dict:
    """Plugin and vLLM versions and the plugin features this server has enabled."""
    facts = getattr(getattr(request.app.state, "art", None), "facts", None)
    return {
        "plugin": "art",
        "plugin_version": __version__,
        "api_server": {"pid": os.getpid(), "plugin_active": install.is_active()},
        "vllm_version": compat.vllm_version(),
        "supported_vllm": compat.SUPPORTED_RANGE_TEXT,
        "model_runner": getattr(facts, "model_runner", None),
        "features": features.snapshot(facts),
        "enabled_features": features.enabled_names(facts),
    }


@router.get("/v1/engine")
async def engine_state(request: Request, engine: int = 0):
    """EngineCore's view: completed engine steps, per-slot versions (by LoRA id), label.
    `?engine=D`: DP engine D's (default 0)."""
    targets = dict(compat.engine_targets(request.app.state.art.engine_client))
    if engine not in targets:
        return _error(404, f"no engine {engine}: this server manages DP ranks {sorted(targets)}")
    return await compat.call_engine_utility_on(
        request.app.state.art.engine_client, targets[engine], "art_slot_state"
    )


@router.get("/v1/slots")
async def slots(request: Request) -> list[dict]:
    """Read from EngineCore: the same on every API server (and every DP engine)."""
    art = request.app.state.art
    listed = await art.slots.list()  # engine 0's registry: its lease book too
    return leases.with_leases(art.slots.lease_book, listed)


@router.post("/v1/lora/update")
async def lora_update(request: Request):
    """Write a new adapter into a slot between two engine steps and bump its version.

    JSON names the adapter's path, or with `transfer` the trainer streams its tensors
    (`api_server/adapter_stream.py`); `multipart/form-data` pushes its files
    (`api_server/adapter_push.py`)."""
    art = request.app.state.art
    push = adapter_push.is_push(request.headers.get("content-type"))
    pushed = plan = config = None
    try:
        if push:
            pushed = await adapter_push.receive(
                request, art.updates.staging, art.updates.check_push
            )
            update = pushed.request
        else:
            try:
                body = await request.json()
            except ValueError as exc:
                raise UpdateError(400, f"body is not valid JSON: {exc}") from exc
            if is_adapter_stream(body):
                try:
                    update, plan, config = parse_adapter_stream(body)
                except UpdateRequestError as exc:
                    raise UpdateError(400, str(exc)) from exc
            else:
                update = parse_update(body)
    except UpdateError as exc:
        art.updates.failed_unattributed += 1
        return _error(exc.status, exc.message)
    try:
        if plan is not None:
            return await art.adapter_streams.update(update, plan, config)
        return await art.updates.update(update, pushed)  # owns `pushed` from here on
    except UpdateError as exc:
        return _error(exc.status, exc.message)


@router.post("/v1/weights/update")
async def weights_update(request: Request):
    """Write new full (base) weights between two engine steps on every engine, or on none,
    and bump the base version (`api_server/base_updates.py`). JSON body
    `{"path", "version"[, "operation_id", "expected_version", "digest"]}`, or with
    `"transfer": {plan}` instead of `path`: the trainer streams the weights over the group
    of `POST /art/v1/weights/transfer/init` (`art_protocol.weight_transfer`)."""
    art = request.app.state.art
    plan = None
    try:
        try:
            body = await request.json()
        except ValueError as exc:
            raise UpdateError(400, f"body is not valid JSON: {exc}") from exc
        try:
            if is_transfer(body):
                update, plan = parse_transfer_update(body)
            else:
                update = parse_weights_update(body)
        except UpdateRequestError as exc:
            raise UpdateError(400, str(exc)) from exc
    except UpdateError as exc:
        art.updates.failed_unattributed += 1
        return _error(exc.status, exc.message)
    try:
        stall_s = _test_stall_window(request)
        if plan is not None:
            return await art.base_updates.update_stream(update, plan, stall_s)
        return await art.base_updates.update(update, stall_s)
    except UpdateError as exc:
        return _error(exc.status, exc.message)


#: Test-only header of `POST /art/v1/weights/update` (honoured only with ART_TEST_HOOKS=1):
#: this update's stall window in seconds instead of `--art-weights-stall-timeout`, so a test
#: can make a stall end within seconds on a shared server started with the default.
STALL_TEST_HEADER = "x-art-test-stall-timeout"


def _test_stall_window(request: Request) -> float | None:
    value = request.headers.get(STALL_TEST_HEADER)
    if value is None or os.environ.get("ART_TEST_HOOKS") != "1":
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise UpdateError(400, f"{STALL_TEST_HEADER}: expected a positive number, got {value!r}")
    return seconds


@router.post("/v1/weights/transfer/init")
async def weights_transfer_init(request: Request):
    """Every worker of every DP engine joins the trainer's weight-transfer group (JSON
    `{"init_info": {...}}`, the engine's: for `art_gloo` `master_address`, `master_port`,
    `world_size`[, `rank_offset`, `timeout_s`]; `art_nixl` takes the same and
    `stall_timeout_s`). Answers once every worker has joined."""
    art = request.app.state.art
    try:
        try:
            body = await request.json()
        except ValueError as exc:
            raise UpdateError(400, f"body is not valid JSON: {exc}") from exc
        init_info = body.get("init_info") if isinstance(body, dict) else None
        if not isinstance(init_info, dict):
            raise UpdateError(400, 'body must be a JSON object {"init_info": {...}}')
        return await art.base_updates.init_transfer(init_info)
    except UpdateError as exc:
        return _error(exc.status, exc.message)


@router.get("/v1/weights")
async def weights(request: Request) -> dict:
    """The base weights as engine 0's registry has them: version, digest, update counts and
    whether they are blocked; `staging`: what a streamed version costs each worker of
    each engine (shard and held bytes, where it stages, the staging budget) and the path its
    commit takes (modules copied, modules rebuilt, and why: `worker/shard_commit.py`); and
    `progress`: while a full-weight update stages, per engine the bytes and tensors received
    of its total and the seconds since anything arrived (`api_server/base_progress.py`),
    else null. While an update runs, an engine that does not answer within a second (one
    of several workers receives a stream between steps) leaves the version and `staging` as
    last read, with `engines_answered: false`. `commit_window`: whether this server's
    commits pause every engine at one step (an MoE model's experts across DP engines: why),
    how many windows this API server opened (and how many inside a client's pause), and the
    last one's pause and whole length (`api_server/expert_cut.py`)."""
    art = request.app.state.art
    updates = art.base_updates
    progress = await updates.progress.view()

    async def read_engines():
        await art.slots.refresh(force=True)
        return await updates.staging()

    answered, engines = await updates.progress.bounded(read_engines)
    base = dict(art.slots.base)
    base.pop("name", None)
    base.pop("lora_int_id", None)
    base["staging"] = {"budget_bytes": updates.staging_budget, "engines": engines}
    if not answered:  # an engine receiving a stream between steps answers once it is in
        base["engines_answered"] = False
    base["progress"] = progress
    base["commit_window"] = expert_cut.window_of(art.engine_client).figures()
    return base


#: Faults the test hook arms: a commit that fails after its writes (restored), a staging that
#: fails, a commit whose restore is reported failed (the slot is blocked: blocked_slots), a
#: commit call sent late (`commit_lags`).
FAULT_KINDS = ("commit", "stage", "unknown", "lag")


@router.post("/v1/test/fault")
async def test_fault(request: Request):
    """Test-only fault hook (404 unless the server runs with ART_TEST_HOOKS=1).

    Body `{"kind": "commit"|"stage"|"unknown", "rank": R[, "engine": D]}`: on worker rank R
    of DP engine D (default 0), the next update's commit fails after writing its weights
    ("commit"), or its staging fails ("stage"), to exercise the all-or-nothing restore; with
    "unknown" the commit fails and its restore is reported failed (the blocked-slot rule).
    `{"kind": "lag", "seconds": S, "engine": D}`: this API server sends the next commit call
    to engine D S seconds late (`commit_lags`).
    """
    if os.environ.get("ART_TEST_HOOKS") != "1":
        return _error(404, "Not Found")
    body = await request.json()
    kind, rank, engine = body.get("kind"), body.get("rank"), body.get("engine", 0)
    targets = dict(compat.engine_targets(request.app.state.art.engine_client))
    if kind == "lag":
        seconds = body.get("seconds")
        if not isinstance(seconds, (int, float)) or not 0 < seconds <= 60 or engine not in targets:
            return _error(
                400,
                f'body must be {{"kind": "lag", "seconds": <0..60>, "engine": <dp rank in '
                f"{sorted(targets)}>}}",
            )
        commit_lags.arm(engine, float(seconds))
        return {"armed": {"kind": kind, "seconds": seconds, "engine": engine}}
    if kind not in FAULT_KINDS or not isinstance(rank, int) or engine not in targets:
        return _error(
            400,
            'body must be {"kind": "commit"|"stage"|"unknown", "rank": <int>, '
            f'"engine": <dp rank in {sorted(targets)}>}}',
        )
    await compat.call_engine_utility_on(
        request.app.state.art.engine_client, targets[engine], "art_test_inject_fault", kind, rank
    )
    return {"armed": {"kind": kind, "rank": rank, "engine": engine}}


@router.post("/v1/test/hold")
async def test_hold(request: Request):
    """Test-only step hold (404 unless the server runs with ART_TEST_HOOKS=1).

    Body `{"step": N[, "engine": D]}`: once DP engine D (default 0) has completed N steps, it
    freezes its running requests itself, as `POST /pause?mode=keep` does, so that an update
    sent next lands after exactly that step; `POST /resume` continues. 409 when step N has
    already passed.
    """
    if os.environ.get("ART_TEST_HOOKS") != "1":
        return _error(404, "Not Found")
    body = await request.json()
    step, engine = body.get("step"), body.get("engine", 0)
    targets = dict(compat.engine_targets(request.app.state.art.engine_client))
    if not isinstance(step, int) or isinstance(step, bool) or engine not in targets:
        return _error(
            400, f'body must be {{"step": <int>, "engine": <dp rank in {sorted(targets)}>}}'
        )
    try:
        await compat.call_engine_utility_on(
            request.app.state.art.engine_client, targets[engine], "art_test_hold_at_step", step
        )
    except Exception as exc:  # the engine's ValueError comes back wrapped by vLLM
        if "has passed" in str(exc):
            return _error(409, str(exc))
        raise
    return {"armed": {"step": step, "engine": engine}}


router.include_router(lease_routes.router)  # /art/v1/leases
