"""Publishing a validated adapter to the engine: stage on every worker, then one swap.

Runs in the API server, after the adapter's bytes were read once and validated
(`art_vllm_plugin.adapters`):

1. write the validated bytes to a fresh staging directory (`art_vllm_plugin.staging`);
2. one EngineCore utility call has every worker start staging on a background thread
   (the step loop is held for one RPC round trip);
3. wait here, off the engine, for every worker's `ready`/`failed` marker;
4. one EngineCore utility call swaps the staged tensors in on every worker, all or nothing,
   and bumps the slot's version (`engine_core/slot_updates.py`);
5. remove the staging directory, whatever happened.

Errors are sorted by what is known: the adapter refused by a worker's loader is 422 (the old
version keeps serving); a failed commit whose workers all restored the previous weights is
500 (the old version keeps serving, the engine is fine); an engine that died or could not
restore is 503 (the slot's state is unknown: restart the server).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass

from art_vllm_plugin import compat, staging
from art_vllm_plugin.adapters import AdapterFiles

#: How long workers may take to stage an adapter before the update is abandoned.
STAGE_TIMEOUT_S = 300.0
_POLL_S = 0.003


class PublishError(Exception):
    """The update did not commit; `status` says whose fault and what is known."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class PublishResult:
    step: int
    engine_ms: float
    stall_ms: float
    stage_ms: float
    resalted_waiting: int


def _engine_failure(exc: BaseException, during: str, keeps: str) -> PublishError:
    if isinstance(exc, compat.engine_dead_error_class()):
        return PublishError(503, f"the engine died during {during} ({exc}); restart the server")
    return PublishError(
        500, f"the engine failed during {during} ({type(exc).__name__}: {exc}); {keeps}"
    )


async def publish(
    engine_client,
    *,
    lora_int_id: int,
    slot: str,
    files: AdapterFiles,
    version: int,
    current_version: int,
    config: staging.StagingConfig,
) -> PublishResult:
    keeps = f"slot {slot!r} keeps serving version {current_version}"
    token = uuid.uuid4().hex
    stage_dir = await asyncio.to_thread(_write_stage, config, slot, version, files)
    staged = False
    committed = False
    try:
        t0 = time.perf_counter()
        try:
            res = await compat.call_engine_utility(
                engine_client,
                "art_stage_lora_update",
                token,
                lora_int_id,
                slot,
                str(stage_dir),
                version,
            )
        except Exception as exc:
            raise _engine_failure(exc, "staging", keeps) from exc
        if not res["ok"]:
            raise PublishError(409, f"{res['error']}; nothing changed")
        staged = True
        await _wait_staged(stage_dir, res["ranks"], files, keeps)
        stage_ms = (time.perf_counter() - t0) * 1000.0
        try:
            res = await compat.call_engine_utility(engine_client, "art_commit_lora_update", token)
        except Exception as exc:
            staged = False  # the engine may have committed; no abort can be trusted now
            raise PublishError(
                503,
                f"the engine failed during the commit ({type(exc).__name__}: {exc}); whether "
                f"slot {slot!r} serves version {current_version} or {version} is unknown; "
                "restart the server",
            ) from exc
        staged = False
        if not res["ok"]:
            if res["kind"] == "stale":
                raise PublishError(409, f"{res['error']}; nothing changed")
            if res.get("restored"):
                raise PublishError(
                    500,
                    f"the engine failed to commit the update ({res['error']}); every worker "
                    f"restored its previous weights; {keeps}",
                )
            raise PublishError(
                503,
                f"the engine failed to commit the update ({res['error']}) and could not "
                f"restore every worker; slot {slot!r}'s weights are unknown; restart the server",
            )
        committed = True
        return PublishResult(
            step=res["step"],
            engine_ms=res["engine_ms"],
            stall_ms=res["stall_ms"],
            stage_ms=stage_ms,
            resalted_waiting=res["resalted_waiting"],
        )
    finally:
        if staged and not committed:
            # If the engine is gone, nothing staged can be used any more anyway.
            with contextlib.suppress(Exception):
                await compat.call_engine_utility(engine_client, "art_abort_lora_update", token)
        await asyncio.to_thread(staging.remove, stage_dir)


def _write_stage(config, slot, version, files: AdapterFiles):
    stage_dir = staging.new_stage_dir(config, slot, version)
    try:
        staging.write_files(stage_dir, files.as_files())
    except BaseException:
        staging.remove(stage_dir)
        raise
    return stage_dir


async def _wait_staged(stage_dir, ranks: list[int], files: AdapterFiles, keeps: str) -> None:
    deadline = time.monotonic() + STAGE_TIMEOUT_S
    while True:
        ready, failed = staging.poll(stage_dir, ranks)
        if failed:
            rank, text = sorted(failed.items())[0]
            kind, _, error = text.partition("\n")
            if kind == "adapter":
                raise PublishError(
                    422, f"engine refused the adapter at {files.path}: {error}; {keeps}"
                )
            raise PublishError(
                500, f"worker rank {rank} failed to stage the adapter ({error}); {keeps}"
            )
        if len(ready) == len(ranks):
            return
        if time.monotonic() > deadline:
            raise PublishError(
                500,
                f"workers {sorted(set(ranks) - set(ready))} did not stage the adapter within "
                f"{STAGE_TIMEOUT_S:.0f} s; {keeps}",
            )
        await asyncio.sleep(_POLL_S)
