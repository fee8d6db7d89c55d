"""Publishing a validated adapter to every engine: stage everywhere, then commit everywhere.

Runs in the API server, after the adapter's bytes were read once, validated and digested
(`art_vllm_plugin.adapters`, `art_protocol.digest`). With data parallelism
(`--data-parallel-size N`) the API server manages N engines, each with its own workers; the
update is a two-phase commit over all of them, reached one by one through
`compat.engine_targets` / `compat.call_engine_utility_on` (vLLM's own `call_utility_async`
reaches engine 0 only, or returns only the first engine's answer):

1. write the validated bytes once to a fresh staging directory (`art_vllm_plugin.staging`),
   with one marker directory per engine, after checking that the directory has room for them
   (507 otherwise; a write that still fails is 507 on a full file system, else 500, and
   nothing stays staged). A pushed adapter (`api_server/adapter_push.py`) was streamed into
   its staging directory as it arrived: only the marker directories are added;
2. *prepare*: one utility call per engine has every worker of that engine start staging on a
   background thread (each engine's step loop is held for one RPC round trip). An engine
   refuses a version it committed before with another digest (409); one where another slot's
   update is between its commit and its finish answers `busy` and is asked again;
3. wait here, off the engines, for every worker's `ready`/`failed` marker of every engine
   (an adapter's stage for at most `STAGE_TIMEOUT_S`; a full-weight stage until it stalls:
   `stage_deadline`);
4. *commit* only if every engine prepared: one utility call per engine swaps the staged
   tensors in on all its workers (all or nothing within the engine) and records the version,
   path and digest in that engine's slot registry; if any engine fails to commit, the
   engines that committed revert (`art_revert_lora_update`), so every engine ends on the old
   version. Where an MoE model's experts span the engines, this step runs while every engine
   is paused at one step of their group (`api_server/expert_cut.py`);
5. abort what is still staged and remove the staging directory, whatever happened.

Errors are sorted by what is known: the adapter refused by a worker's loader is 422 (the old
version keeps serving); a failure after which every engine and worker is back on the previous
weights is 500 (the old version keeps serving); an engine that died or could not restore is
503 (the slot's state is unknown: `PublishError.state_unknown`, the caller blocks the slot).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from dataclasses import dataclass
from pathlib import Path

from art_protocol.weight_updates import slot_named
from art_vllm_plugin import compat, host_layout, stage_progress, staging
from art_vllm_plugin.adapters import AdapterFiles
from art_vllm_plugin.api_server import commit_lags, expert_cut
from art_vllm_plugin.api_server.stage_deadline import EngineSeen, StallRule, StallWatch

#: How long workers may take to stage an adapter before the update is abandoned, and how long
#: a stage call answered `busy` is asked again. A full-weight stage has no fixed deadline: it
#: ends when it stalls (`stage_deadline`).
STAGE_TIMEOUT_S = 300.0
_POLL_S = 0.003
#: Between marker reads of engines on other hosts (each is a utility call to the engine).
_REMOTE_POLL_S = 0.02
#: Between looks at the progress records while a stage call has not answered yet (an engine
#: of several workers that was idle receives a stream inside its stage call).
_STAGE_CALL_POLL_S = 0.05
#: How often a progressing full-weight stage pushes back the engines' limit on an update's
#: life (`art_renew_update`; `slot_registry.RESERVATION_TTL_S` is 900 s).
RENEW_EVERY_S = 60.0
#: Calls that end a stalled update (abort, finish) wait at most this long here: an engine
#: whose workers still block in the stalled receive answers them only once it ends, and the
#: update's caller is answered meanwhile (the calls go on in the background).
CLEANUP_WAIT_S = 5.0
#: Calls still running in the background (kept referenced until they end).
_BACKGROUND: set[asyncio.Future] = set()


class PublishError(Exception):
    """The update did not commit; `status` says whose fault and what is known.
    `state_unknown`: some engine or worker may hold the new weights under the old label."""

    def __init__(self, status: int, message: str, state_unknown: bool = False):
        super().__init__(message)
        self.status = status
        self.message = message
        self.state_unknown = state_unknown


@dataclass(frozen=True)
class Engine:
    """One DP engine this API server manages. `remote`: it runs on another host, so it cannot
    see this server's staging directory and gets the adapter's bytes in the stage call
    (`engine_core/relayed_stages.py`)."""

    dp_rank: int
    identity: object
    remote: bool = False


@dataclass(frozen=True)
class PublishResult:
    step: int  # engine 0's step
    engine_ms: float  # the slowest engine's commit call
    stall_ms: float  # the largest engine stall (stage + commit)
    stage_ms: float
    resalted_waiting: int
    receipts: list[dict]


def engines_of(engine_client) -> list[Engine]:
    remote = host_layout.remote_dp_ranks(engine_client.vllm_config.parallel_config)
    return [
        Engine(rank, ident, rank in remote) for rank, ident in compat.engine_targets(engine_client)
    ]


async def call(engine_client, engine: Engine, method: str, *args):
    return await compat.call_engine_utility_on(engine_client, engine.identity, method, *args)


async def call_all(engine_client, engines: list[Engine], method: str, *args) -> list:
    """One call per engine, concurrently; an engine's exception is returned, not raised."""
    return await asyncio.gather(
        *(call(engine_client, e, method, *args) for e in engines), return_exceptions=True
    )


async def _commit(engine_client, engine: Engine, token, path, digest, operation_id):
    await commit_lags.wait_before_commit(engine.dp_rank)  # a test hook; no wait unless armed
    return await call(
        engine_client, engine, "art_commit_lora_update", token, path, digest, operation_id
    )


def engine_failure(exc: BaseException, during: str, keeps: str) -> PublishError:
    if isinstance(exc, compat.engine_dead_error_class()):
        return PublishError(503, f"the engine died during {during} ({exc}); restart the server")
    return PublishError(
        500, f"the engine failed during {during} ({type(exc).__name__}: {exc}); {keeps}"
    )


async def publish(
    engine_client,
    engines: list[Engine],
    *,
    token: str,
    lora_int_id: int,
    slot: str,
    files: AdapterFiles,
    path: str,
    digest: str,
    version: int,
    current_version: int,
    config: staging.StagingConfig,
    operation_id: str | None = None,
    pushed_dir: Path | None = None,
) -> PublishResult:
    """`pushed_dir`: the directory a push already wrote `files` to (removed here like any
    stage)."""
    keeps = f"slot {slot!r} keeps serving version {current_version}"
    try:
        stage_dir = await asyncio.to_thread(
            _write_stage, config, slot, version, files, engines, pushed_dir
        )
    except staging.StagingRefused as exc:
        raise PublishError(exc.status, f"{exc}; {keeps}") from exc
    try:
        return await stage_and_commit(
            engine_client,
            engines,
            token=token,
            stage_calls=[
                _stage_call(e, stage_dir, token, lora_int_id, slot, files, version, digest)
                for e in engines
            ],
            stage_dir=stage_dir,
            what=f"the adapter at {files.path}",
            keeps=keeps,
            slot=slot,
            version=version,
            digest=digest,
            path=path,
            operation_id=operation_id,
        )
    finally:
        if remote := [e for e in engines if e.remote]:
            with contextlib.suppress(Exception):  # an engine that is gone took its host's copy
                await call_all(engine_client, remote, "art_drop_relayed", token)
        await asyncio.to_thread(staging.remove, stage_dir)


async def stage_and_commit(
    engine_client,
    engines: list[Engine],
    *,
    token: str,
    stage_calls: list[tuple],
    stage_dir: Path,
    what: str,
    keeps: str,
    slot: str,
    version: int,
    digest: str | None,
    path: str | None,
    operation_id: str | None,
    check_staged=None,
    stall: StallRule | None = None,
) -> PublishResult:
    """Steps 2-4 of the module docstring for an update already written to `stage_dir`:
    `stage_calls[i]` is the (utility, *args) that starts staging on `engines[i]`; `what` names
    the update in errors. `check_staged(ranks)`, when given, runs once every worker staged
    (`ranks[i]`: engine i's) and returns the digest to commit with, or raises `PublishError`
    (a streamed update's digest is known only once received). `stall`: a full-weight stage,
    whose workers report progress: it is ended when it stalls (`stage_deadline`), not after
    `STAGE_TIMEOUT_S`. What is still staged when this fails is aborted; the caller owns
    `stage_dir`."""
    staged: list[Engine] = []
    committed = False
    watch = None if stall is None else StallWatch(stall)
    renew = None if watch is None else _Renewal(engine_client, engines, token)
    try:
        t0 = time.perf_counter()
        results = await _stage_everywhere(
            engine_client, engines, stage_calls, stage_dir, token, watch, renew, what, keeps
        )
        staged = [e for e, r in zip(engines, results, strict=True) if isinstance(r, dict)]
        for e, res in zip(engines, results, strict=True):
            if isinstance(res, BaseException):
                raise engine_failure(res, f"staging on engine {e.dp_rank}", keeps) from res
        for e, res in zip(engines, results, strict=True):
            if not res["ok"]:
                kind = res.get("kind")
                # busy past the deadline: 503; no room on a remote engine's host: its status
                status = {"busy": 503, "staging": res.get("status", 500)}.get(kind, 409)
                where = f" (engine {e.dp_rank})" if kind == "staging" else ""
                raise PublishError(status, f"{res['error']}{where}; nothing changed")
        ranks = [r["ranks"] for r in results]
        await wait_staged(
            engine_client, stage_dir, engines, ranks, what, keeps, token, watch, renew
        )
        if check_staged is not None:
            digest = await check_staged(ranks)
        stage_ms = (time.perf_counter() - t0) * 1000.0
        # An MoE model's experts across engines: no engine steps from the commit to the
        # last revert (expert_cut); elsewhere each engine commits at its own next step.
        try:
            async with expert_cut.commit_window(engine_client):
                results = await asyncio.gather(
                    *(
                        _commit(engine_client, e, token, path, digest, operation_id)
                        for e in engines
                    ),
                    return_exceptions=True,
                )
                staged = []  # a commit call consumes what was staged, whatever its outcome
                await settle_commits(engine_client, engines, results, token, slot, version, keeps)
        except expert_cut.CommitWindowError as exc:
            raise PublishError(500, f"{exc}; {keeps}") from exc
        committed = True
        receipts = [
            {
                "engine": e.dp_rank,
                "step": r["step"],
                "version": version,
                "digest": digest,
                "workers": r["workers"],
            }
            for e, r in zip(engines, results, strict=True)
        ]
        return PublishResult(
            step=results[0]["step"],
            engine_ms=max(r["engine_ms"] for r in results),
            stall_ms=max(r["stall_ms"] for r in results),
            stage_ms=stage_ms,
            resalted_waiting=sum(r["resalted_waiting"] for r in results),
            receipts=receipts,
        )
    finally:
        if staged and not committed:
            # If an engine is gone, nothing staged there can be used any more anyway. One
            # whose workers still block in a stalled receive answers once it ends.
            await in_background(call_all(engine_client, staged, "art_abort_lora_update", token))


def cleanup_pending() -> bool:
    """Whether some call of an update that ended still waits on an engine (one whose workers
    block in a stalled receive answers nothing until it ends)."""
    return any(not task.done() for task in _BACKGROUND)


async def in_background(call, wait_s: float = CLEANUP_WAIT_S) -> None:
    """Await `call` for at most `wait_s`; past that it goes on in the background (kept
    referenced until it ends). Its outcome is not needed: cleanup of an update that ended."""
    task = asyncio.ensure_future(call)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
    with contextlib.suppress(Exception):  # a timeout included
        await asyncio.wait_for(asyncio.shield(task), wait_s)


def stall_error(stalled: str, what: str, keeps: str) -> PublishError:
    return PublishError(
        500, f"staging {what} stalled: {stalled}; every engine aborted the update; {keeps}"
    )


class _Renewal:
    """Pushes back the engines' limit on the update's life (`art_renew_update`) every
    `RENEW_EVERY_S` while its stage progresses; one call in flight at a time (an engine
    whose workers receive between steps answers only once they are done)."""

    def __init__(self, engine_client, engines: list[Engine], token: str):
        self.engine_client, self.engines, self.token = engine_client, engines, token
        self.at = time.monotonic()
        self.task: asyncio.Future | None = None

    def progressed(self) -> None:
        now = time.monotonic()
        if now - self.at < RENEW_EVERY_S or (self.task is not None and not self.task.done()):
            return
        self.at = now
        self.task = asyncio.ensure_future(
            call_all(self.engine_client, self.engines, "art_renew_update", self.token)
        )
        _BACKGROUND.add(self.task)
        self.task.add_done_callback(_BACKGROUND.discard)


async def _stage_everywhere(
    engine_client, engines, stage_calls, stage_dir, token, watch, renew, what, keeps
) -> list:
    """Every engine's answer to its stage call (an exception returned, not raised). With a
    `watch`, a stall is looked for meanwhile: an engine of several workers that was idle
    receives a stream inside its stage call. A stalled one is answered with the stall (its
    call goes on; what it stages then is aborted once it answers)."""
    deadline = time.monotonic() + STAGE_TIMEOUT_S  # for `busy` answers
    task = asyncio.ensure_future(
        asyncio.gather(
            *(
                stage_on(engine_client, e, deadline, *call)
                for e, call in zip(engines, stage_calls, strict=True)
            ),
            return_exceptions=True,
        )
    )
    if watch is None:
        return await task
    local = [e for e in engines if not e.remote]  # a remote one's markers are on its host
    while True:
        done, _ = await asyncio.wait({task}, timeout=_STAGE_CALL_POLL_S)
        if done:
            return task.result()
        seen = await asyncio.to_thread(_look_before_answer, stage_dir, local)
        if (stalled := watch.stalled(seen)) is not None:
            task.add_done_callback(functools.partial(_abort_late, engine_client, engines, token))
            _BACKGROUND.add(task)
            task.add_done_callback(_BACKGROUND.discard)
            raise stall_error(stalled, what, keeps)
        renew.progressed()


def _look_before_answer(stage_dir, engines: list[Engine]) -> list[EngineSeen]:
    """What each local engine's workers show before its stage call answered: the ranks with
    a progress record and no marker yet are the ones staging (none yet: unknown)."""
    seen = []
    for engine in engines:
        markers = staging.marker_dir(stage_dir, engine.dp_rank)
        progress = stage_progress.read(markers)
        ready, failed = staging.poll(markers, sorted(progress))
        waiting = [r for r in sorted(progress) if r not in ready and r not in failed]
        seen.append(EngineSeen(engine.dp_rank, waiting if progress else None, progress))
    return seen


def _abort_late(engine_client, engines, token, task: asyncio.Future) -> None:
    """Once the stage calls of a stalled update answered: abort it where it staged."""
    if task.cancelled() or task.exception() is not None:
        return
    ok = [e for e, r in zip(engines, task.result(), strict=True) if isinstance(r, dict) and r["ok"]]
    if ok:
        late = asyncio.ensure_future(call_all(engine_client, ok, "art_abort_lora_update", token))
        _BACKGROUND.add(late)
        late.add_done_callback(_BACKGROUND.discard)


async def settle_commits(engine_client, engines, results, token, slot, version, keeps) -> None:
    """Return if every engine committed; else revert the engines that did and raise."""
    ok = [e for e, r in zip(engines, results, strict=True) if isinstance(r, dict) and r["ok"]]
    if len(ok) == len(engines):
        return
    died = [(e, r) for e, r in zip(engines, results, strict=True) if isinstance(r, BaseException)]
    refused = [
        (e, r) for e, r in zip(engines, results, strict=True) if isinstance(r, dict) and not r["ok"]
    ]
    if refused and not died and all(r["kind"] == "stale" for _, r in refused) and not ok:
        raise PublishError(409, f"{refused[0][1]['error']}; nothing changed")
    reverts = await call_all(engine_client, ok, "art_revert_lora_update", token)
    reverted = all(isinstance(r, dict) and r["ok"] for r in reverts)
    errors = "; ".join(
        [f"engine {e.dp_rank}: {type(r).__name__}: {r}" for e, r in died]
        + [f"engine {e.dp_rank}: {r['error']}" for e, r in refused]
        + [
            f"engine {e.dp_rank} revert: {r if isinstance(r, BaseException) else r['error']}"
            for e, r in zip(ok, reverts, strict=True)
            if not (isinstance(r, dict) and r["ok"])
        ]
    )
    if not died and reverted and all(r.get("restored") for _, r in refused):
        reverted_text = f" engines {[e.dp_rank for e in ok]} reverted;" if ok else ""
        raise PublishError(
            500,
            f"the engine failed to commit the update ({errors});{reverted_text} every worker "
            f"restored its previous weights on every engine; {keeps}",
        )
    raise PublishError(
        503,
        f"the update failed to commit on every engine ({errors}) and not every engine could "
        f"be restored; whether {slot_named(slot)} serve(s) the previous version or {version} is "
        "unknown",
        state_unknown=True,
    )


def _stage_call(e: Engine, stage_dir, token, lora_int_id, slot, files, version, digest) -> tuple:
    """(utility, *args) that stages on engine `e`: from this server's stage directory, or,
    for an engine on another host, from the bytes themselves (`relayed_stages`)."""
    if e.remote:
        return (
            *("art_stage_relayed", token, lora_int_id, slot, files.as_files()),
            *(version, digest, e.dp_rank),
        )
    markers = str(staging.marker_dir(stage_dir, e.dp_rank))
    return (
        *("art_stage_lora_update", token, lora_int_id, slot, str(stage_dir)),
        *(version, markers, digest),
    )


async def stage_on(engine_client, engine: Engine, deadline: float, method: str, *args) -> dict:
    """Start staging on one engine, asking again while it answers `busy` (another slot's
    update is between its commit and its finish there: a few utility calls)."""
    while True:
        res = await call(engine_client, engine, method, *args)
        if res["ok"] or res.get("kind") != "busy" or time.monotonic() > deadline:
            return res
        await asyncio.sleep(_POLL_S)


def _write_stage(
    config: staging.StagingConfig, slot, version, files: AdapterFiles, engines, pushed_dir=None
) -> Path:
    """A stage directory holding `files` and one marker directory per engine; nothing is left
    behind when it fails (`staging.StagingRefused`: 507 when out of space, else 500)."""
    what = f"adapter {slot}@{version}"
    if pushed_dir is None:
        config.check_space(len(files.config) + len(files.weights), what)
    return staging.fill_stage(
        config,
        slot,
        version,
        [e.dp_rank for e in engines],
        lambda stage_dir: staging.write_files(stage_dir, files.as_files()),
        what,
        pushed_dir,
    )


def _poll_local(stage_dir, pending, progress: bool) -> list[tuple | None]:
    """Each pending local engine's (ranks ready, {rank: error}, {rank: progress record}) from
    its marker directory; records only when `progress` is asked for."""
    out = []
    for engine, ranks in pending:
        if engine.remote:
            out.append(None)
            continue
        markers = staging.marker_dir(stage_dir, engine.dp_rank)
        records = stage_progress.read(markers, ranks) if progress else {}
        out.append((*staging.poll(markers, ranks), records))
    return out


async def _poll_all(engine_client, stage_dir, pending, token: str, progress: bool) -> list:
    """Markers of local engines are files here: read on a thread, never with the event
    loop's time. A remote engine reads its own (`art_stage_markers`, `art_stage_progress`),
    at most every `_REMOTE_POLL_S` (each read is a utility call on its busy loop)."""
    polled = await asyncio.to_thread(_poll_local, stage_dir, pending, progress)
    for i, (engine, engine_ranks) in enumerate(pending):
        if engine.remote:
            ready, failed = await call(
                engine_client, engine, "art_stage_markers", token, engine_ranks
            )
            records = {}
            if progress:
                answer = await call(engine_client, engine, "art_stage_progress", token)
                records = stage_progress.records_of(answer)
            polled[i] = (ready, {int(k): v for k, v in failed.items()}, records)
    return polled


async def wait_staged(
    engine_client,
    stage_dir,
    engines: list[Engine],
    ranks: list[list[int]],
    what: str,
    keeps: str,
    token: str,
    watch: StallWatch | None = None,
    renew: _Renewal | None = None,
) -> None:
    """Until every worker of every engine left its marker: a worker that refused the update
    (`adapter` kind) is 422 naming `what` was staged, any other failure 500. Without a
    `watch` the workers have `STAGE_TIMEOUT_S`; with one (a full-weight stage), until no
    worker of some engine still staging received anything for the watch's stall window, and
    `renew` pushes back the engines' limit on the update's life meanwhile."""
    deadline = time.monotonic() + STAGE_TIMEOUT_S
    pending = list(zip(engines, ranks, strict=True))
    while pending:
        still, seen = [], []
        polled = await _poll_all(engine_client, stage_dir, pending, token, watch is not None)
        for (engine, engine_ranks), (ready, failed, records) in zip(pending, polled, strict=True):
            if failed:
                rank, text = sorted(failed.items())[0]
                kind, _, error = text.partition("\n")
                if kind == "adapter":
                    raise PublishError(422, f"engine refused {what}: {error}; {keeps}")
                raise PublishError(
                    500,
                    f"engine {engine.dp_rank} worker rank {rank} failed to stage {what} "
                    f"({error}); every engine aborted the update; {keeps}",
                )
            if len(ready) < len(engine_ranks):
                still.append((engine, engine_ranks))
                waiting = [r for r in engine_ranks if r not in ready]
                seen.append(EngineSeen(engine.dp_rank, waiting, records))
        pending = still
        if not pending:
            return
        if watch is not None:
            if (stalled := watch.stalled(seen)) is not None:
                raise stall_error(stalled, what, keeps)
            if renew is not None:
                renew.progressed()
        elif time.monotonic() > deadline:
            late = {e.dp_rank: r for e, r in pending}
            raise PublishError(
                500,
                f"workers of engines {sorted(late)} did not stage {what} within "
                f"{STAGE_TIMEOUT_S:.0f} s; every engine aborted the update; {keeps}",
            )
        await asyncio.sleep(_REMOTE_POLL_S if any(e.remote for e, _ in pending) else _POLL_S)
