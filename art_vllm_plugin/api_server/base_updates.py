"""The API server's half of a full-weight update (`POST /art/v1/weights/update`).

The same steps and guarantees as a LoRA slot update (`update_coordinator`, `slot_publish`),
for the base weights under the registry key `BASE_SLOT`:

1. admit on engine 0 (`art_reserve_update`): `operation_id` replay, `expected_version`
   compare-and-swap on the base version, one base update at a time across API servers;
2. copy the trainer's safetensors directory to a fresh stage and check the copy against the
   served model (names, dtypes, shapes, finite values) and the request's digest
   (`base_files`): a bad update is refused (422) naming every problem, nothing changed;
3. stage on every worker of every DP engine (`art_stage_base_update`: the workers read the
   files into host memory off the step loop), wait for every marker;
4. commit on every engine, riding each engine's next step (the base version, label and cache
   salts change with the weights, between two steps); if any engine fails, the engines that
   committed revert (their workers read the previous weights again), so every engine ends on
   the old weights (500), or, when some worker could not restore, the base weights are
   blocked on every engine (503: every request refused until a full-weight update commits
   everywhere);
5. record the outcome on every engine (`art_finish_update`), which makes the commit final.

The committed stage stays on disk while its version is current: it is what a revert of the
next update reads (the workers keep no copy of the weights, `worker/base_weights.py`). Once
an update is final, every base stage of an older version that this server wrote is removed,
whichever of its API servers wrote it (`staging.remove_superseded_base`: a stage records its
version and the server's id, engine 0's `server_id`, which admission answers; base updates
are one at a time across API servers, so nothing older can be needed again). Another
server's stages in the same directory are left alone: they are its undo source.
Engines on another host than this API server cannot read the stage; an update is refused
(501) when there is one.

A streamed update (`update_stream`, body `transfer`: `art_protocol.weight_transfer`) differs
in step 2 and 3 only: its plan (names, dtypes, shapes) is checked against the served model
before any byte moves (422), the stage holds only the workers' markers, each worker receives
the trainer's stream through its weight-transfer engine, and the digest is the one every
worker reports for what it received (all equal, and the request's when it names one). The
trainer sends once every worker is receiving (`ready_key` in the group's store), so a
refusal before that point costs it nothing. The streamed version's weights stay in the
workers' host memory while current, each worker its shard (what a revert of the next update
writes back); with `--art-weights-staging-bytes` a stream that would take some worker over
that budget (its held shard plus the new one) is refused 507 before it is staged.
`init_transfer` has every worker of every engine join the trainer's group first.

No fixed deadline: a stage (files or stream) is ended only once no worker of some engine
received anything for `--art-weights-stall-timeout` (`stage_deadline`), with a message naming
the engines, worker ranks and bytes received of the total; meanwhile `GET /art/v1/weights`
shows how far each engine got (`base_progress`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from pathlib import Path

from art_protocol.checkpoint_layout import LayoutError, layout_problems, read_layout
from art_protocol.updates import UpdateRequest
from art_protocol.weight_transfer import TransferPlan
from art_protocol.weight_updates import BASE_SLOT
from art_vllm_plugin import staging
from art_vllm_plugin.api_server import base_files, slot_publish
from art_vllm_plugin.api_server.base_progress import RunningStage, StageProgress
from art_vllm_plugin.api_server.paths import PathRefused
from art_vllm_plugin.api_server.stage_deadline import DEFAULT_STALL_S, StallRule
from art_vllm_plugin.api_server.update_coordinator import (
    UpdateCoordinator,
    UpdateError,
    check_digest,
)
from art_vllm_plugin.stage_progress import layout_totals

logger = logging.getLogger("vllm.art_plugin.slots")


def served_checkpoint(model: str) -> Path | None:
    """The served model's local checkpoint directory (what updates are checked against), or
    None when the model was not loaded from a local directory of safetensors."""
    path = Path(model)
    return path if path.is_dir() else None


class BaseUpdater:
    """Runs full-weight updates; one at a time on this API server (and across API servers,
    by engine 0's reservation)."""

    def __init__(
        self,
        coordinator: UpdateCoordinator,
        served_dir: Path | None,
        model: str,
        staging_budget: int | None = None,
        stall_timeout_s: float = DEFAULT_STALL_S,
    ):
        self.coordinator = coordinator
        #: `--art-weights-stall-timeout`: a stage is ended once no worker of some engine
        #: received anything for this long (`stage_deadline`).
        self.stall_timeout_s = stall_timeout_s
        #: `--art-weights-staging-bytes`: host bytes each worker may hold for streamed
        #: versions (the one arriving and the held undo); None: not limited.
        self.staging_budget = staging_budget
        self.view = coordinator.view
        self.engine_client = coordinator.engine_client
        self.engines = coordinator.engines
        self.served_dir = served_dir
        self.model = model
        self._lock = asyncio.Lock()
        #: Held while a stream runs over the transfer group (full weights here, a LoRA
        #: adapter in `adapter_stream`): the group carries one stream at a time.
        self.stream_lock = asyncio.Lock()
        #: The update staging now and how far it got (`GET /art/v1/weights`).
        self.progress = StageProgress(
            self.engine_client, self.engines, stall_timeout_s, self.view.sole_api_server
        )

    async def update(self, req: UpdateRequest, stall_s: float | None = None) -> dict:
        """Run one update to its end, whatever happens to the client (as for slot updates).
        `stall_s`: this update's stall window instead of the server's (a test hook's)."""
        run = functools.partial(self._update_locked, stall_s=stall_s)
        return await asyncio.shield(asyncio.ensure_future(self._update(run, req)))

    async def update_stream(
        self, req: UpdateRequest, plan: TransferPlan, stall_s: float | None = None
    ) -> dict:
        """The same for weights the trainer streams (see the module docstring)."""
        run = functools.partial(self._stream_locked, plan=plan, stall_s=stall_s)
        return await asyncio.shield(asyncio.ensure_future(self._update(run, req)))

    async def init_transfer(self, init_info: dict) -> dict:
        """Every worker of every engine joins the trainer's group, at the same time (each
        engine's workers block until the whole group is there)."""
        t0 = time.perf_counter()
        results = await slot_publish.call_all(
            self.engine_client, self.engines, "art_init_weight_transfer", init_info
        )
        errors = [
            f"engine {e.dp_rank}: {type(r).__name__}: {r}"
            for e, r in zip(self.engines, results, strict=True)
            if isinstance(r, BaseException)
        ]
        if errors:
            raise UpdateError(
                400 if "init_info" in " ".join(errors) else 500,
                f"joining the weight-transfer group failed ({'; '.join(errors)}); the base "
                "weights are unchanged",
            )
        workers = sum(r["workers"] for r in results)
        return {
            "engines": len(self.engines),
            "workers": workers,
            "ms": (time.perf_counter() - t0) * 1e3,
        }

    async def _update(self, run, req: UpdateRequest) -> dict:
        token = uuid.uuid4().hex
        self.view.registry_changing()
        try:
            await self.view.ensure_registered()
            return await run(req, token)
        except BaseException:
            # Ends the reservation; an engine whose workers still block in a stalled
            # receive answers once that ends, and the caller is answered meanwhile.
            await slot_publish.in_background(self.coordinator.note_failure(token, BASE_SLOT))
            raise
        finally:
            self.view.registry_changing()

    def _refuse_unsupported(self, streamed: bool = False) -> None:
        """501 for what full-weight updates cannot do yet; `streamed`: engines on another host
        receive a stream themselves (only files need this host's stage)."""
        if self.served_dir is None:
            raise UpdateError(
                501,
                f"full-weight updates need the served model as a local directory of "
                f"safetensors to check updates against; {self.model!r} is not one (serve the "
                "model from its local directory); nothing changed",
            )
        if not streamed and (remote := [e.dp_rank for e in self.engines if e.remote]):
            raise UpdateError(
                501,
                f"engines {remote} run on another host than this API server and cannot read "
                "its stage; stream the weights instead ('transfer', over the engines' "
                "weight-transfer group); nothing changed",
            )

    async def _update_locked(self, req: UpdateRequest, token: str, stall_s=None) -> dict:
        t0 = time.perf_counter()
        self._refuse_unsupported()
        current = self.view.base.get("version", 0)
        try:
            resolved = self.coordinator.paths.resolve(req.path)
        except PathRefused as exc:
            raise UpdateError(
                403, f"{exc}; the base weights keep serving version {current}"
            ) from exc
        fingerprint = req.fingerprint() if req.operation_id is not None else None
        async with self._lock:
            admitted = await self.coordinator.admit(req, token, fingerprint)
            if not admitted["ok"]:
                return admitted["replayed"]
            current = admitted["version"]
            keeps = f"the base weights keep serving version {current}"
            source = f"the full weights at {resolved}"
            try:
                stage_dir = await asyncio.to_thread(
                    base_files.write_stage,
                    self.coordinator.staging,
                    Path(resolved),
                    req.version,
                    self.engines,
                    admitted["server"],
                    self.coordinator.paths,
                )
            except PathRefused as exc:
                raise UpdateError(403, f"{exc}; {keeps}") from exc
            except base_files.WeightsRefused as exc:
                raise UpdateError(422, f"{exc}; {keeps}") from exc
            except staging.StagingRefused as exc:
                raise UpdateError(exc.status, f"{exc}; {keeps}") from exc
            committed = False
            try:
                result, digest = await self._check_and_publish(
                    req, token, stage_dir, source, keeps, stall_s
                )
                committed = True
            finally:
                if not committed:
                    await asyncio.to_thread(staging.remove, stage_dir)
            return await self._finish(
                req, token, fingerprint, current, digest, result, t0, admitted["server"]
            )

    async def _stream_locked(
        self, req: UpdateRequest, token: str, plan: TransferPlan, stall_s=None
    ) -> dict:
        t0 = time.perf_counter()
        self._refuse_unsupported(streamed=True)
        source = f"the full weights streamed in round {plan.round!r}"
        current = self.view.base.get("version", 0)
        try:
            problems = layout_problems(read_layout(self.served_dir), plan.layout())
        except LayoutError as exc:
            problems = [str(exc)]
        if problems:
            refused = base_files.WeightsRefused(source, problems)
            raise UpdateError(422, f"{refused}; the base weights keep serving version {current}")
        fingerprint = req.fingerprint(plan.body_id())
        if req.operation_id is None:
            fingerprint = None
        async with self._lock, self.stream_lock:
            admitted = await self.coordinator.admit(req, token, fingerprint)
            if not admitted["ok"]:
                return admitted["replayed"]
            keeps = f"the base weights keep serving version {admitted['version']}"
            await self._check_budget(keeps)
            try:
                stage_dir = await asyncio.to_thread(
                    staging.fill_stage,
                    self.coordinator.staging,
                    "base",
                    req.version,
                    [e.dp_rank for e in self.engines],
                    lambda _dir: None,  # markers only: the weights come in the stream
                    source,
                )
            except staging.StagingRefused as exc:
                raise UpdateError(exc.status, f"{exc}; {keeps}") from exc
            try:
                calls = [_stream_call(e, token, plan, req, stage_dir) for e in self.engines]
                totals = layout_totals(plan.layout())
                result = await self._publish(
                    req, token, stage_dir, source, keeps, calls, totals, stall_s=stall_s
                )
            finally:
                if remote := [e for e in self.engines if e.remote]:
                    with contextlib.suppress(Exception):  # a lost engine took its markers
                        await slot_publish.call_all(
                            self.engine_client, remote, "art_drop_relayed", token
                        )
                await asyncio.to_thread(staging.remove, stage_dir)
            digest = result.receipts[0]["digest"]
            return await self._finish(
                req, token, fingerprint, admitted["version"], digest, result, t0, admitted["server"]
            )

    async def staging(self) -> list:
        """Every worker's staging figures, by engine (`art_base_staging`): shard and held
        bytes, where it stages, which path its commit takes."""
        answers = await slot_publish.call_all(self.engine_client, self.engines, "art_base_staging")
        return [
            {"engine": e.dp_rank, "error": f"{type(a).__name__}: {a}"}
            if isinstance(a, BaseException)
            else {"engine": e.dp_rank, "workers": a}
            for e, a in zip(self.engines, answers, strict=True)
        ]

    async def _check_budget(self, keeps: str) -> None:
        """507 before a byte moves when some worker would hold more than the staging budget:
        the new version's shard plus the held undo (the current version's shard, when it
        came as a stream)."""
        if self.staging_budget is None:
            return
        for engine in await self.staging():
            if "error" in engine:
                raise UpdateError(
                    500,
                    f"engine {engine['engine']} did not say what it would stage "
                    f"({engine['error']}); nothing was sent; {keeps}",
                )
            for w in engine["workers"]:
                need = w["shard_bytes"] + w["held_bytes"]
                if need > self.staging_budget:
                    raise UpdateError(
                        507,
                        f"staging this version needs {need} bytes of host memory on worker "
                        f"{w['rank']} of engine {engine['engine']} ({w['shard_bytes']} for its "
                        f"shard, {w['held_bytes']} for the current version's shard kept as the "
                        f"undo), over this server's --art-weights-staging-bytes "
                        f"{self.staging_budget}; nothing was sent; {keeps}",
                    )

    async def _check_and_publish(self, req, token, stage_dir: Path, source, keeps, stall_s):
        try:
            digest = await asyncio.to_thread(
                base_files.check_stage, stage_dir, self.served_dir, source
            )
            totals = await asyncio.to_thread(lambda: layout_totals(read_layout(stage_dir)))
        except base_files.WeightsRefused as exc:
            raise UpdateError(422, f"{exc}; {keeps}") from exc
        check_digest(req, source, digest, keeps)
        calls = [
            (
                "art_stage_base_update",
                token,
                str(stage_dir),
                req.version,
                str(staging.marker_dir(stage_dir, e.dp_rank)),
                digest,
            )
            for e in self.engines
        ]
        result = await self._publish(
            req, token, stage_dir, source, keeps, calls, totals, digest, stall_s
        )
        return result, digest

    async def _publish(
        self, req, token, stage_dir, source, keeps, calls, totals, digest=None, stall_s=None
    ):
        """Stage with `calls` and commit everywhere (`slot_publish.stage_and_commit`); without
        `digest` (a stream), the digest is what every worker reports it received. `totals`:
        the update's (bytes, tensors); the stage ends when it stalls for `stall_s` (default
        the server's `--art-weights-stall-timeout`, `stage_deadline`)."""
        check = None
        if digest is None:
            check = functools.partial(self._streamed_digest, req, token, stage_dir, source, keeps)
        rule = StallRule(stall_s or self.stall_timeout_s, *totals)
        self.progress.running = RunningStage(req.version, token, stage_dir, rule)
        try:
            return await slot_publish.stage_and_commit(
                self.engine_client,
                self.engines,
                token=token,
                stage_calls=calls,
                stage_dir=stage_dir,
                what=source,
                keeps=keeps,
                slot=BASE_SLOT,
                version=req.version,
                digest=digest,
                path=None if digest is None else str(stage_dir),
                operation_id=req.operation_id,
                check_staged=check,
                stall=rule,
            )
        except slot_publish.PublishError as exc:
            raise await self.coordinator.publish_failed(
                exc,
                req,
                "every request is refused (503) until a full-weight update commits on every engine",
            ) from exc
        finally:
            self.progress.running = None

    async def _streamed_digest(self, req, token, stage_dir, source, keeps, ranks) -> str:
        """The digest every worker of every engine reports it received: one value (else 500:
        the engines would serve different weights), the request's when it names one."""
        digests = set()
        for e, engine_ranks in zip(self.engines, ranks, strict=True):
            if e.remote:  # its markers are on its own host
                texts = await slot_publish.call(
                    self.engine_client, e, "art_stage_ready_texts", token, engine_ranks
                )
                texts = list(texts.values())
            else:
                markers = staging.marker_dir(stage_dir, e.dp_rank)
                texts = [staging.ready_text(markers, r) for r in engine_ranks]
            digests |= {json.loads(text)["digest"] for text in texts}
        if len(digests) != 1:
            raise slot_publish.PublishError(
                500,
                f"the workers received different weights from {source} ({sorted(digests)}); "
                f"every engine aborted the update; {keeps}",
            )
        (digest,) = digests
        check_digest(req, source, digest, keeps)
        return digest

    async def _finish(self, req, token, fingerprint, current, digest, result, t0, server: str):
        """Record the committed update on every engine (final: no revert any more), then
        drop this server's stages of the versions before it, whichever of its API servers
        wrote them (`server`: engine 0's `server_id`)."""
        response, elapsed_ms = await self.coordinator.record_committed(
            req, token, fingerprint, current, digest, result, t0
        )
        await asyncio.to_thread(
            staging.remove_superseded_base, self.coordinator.staging.root, req.version, server
        )
        logger.info(
            "art update base weights version=%d step=%d engines=%d total=%.1fms stage=%.1fms "
            "stall=%.2fms",
            req.version,
            result.step,
            len(self.engines),
            elapsed_ms,
            result.stage_ms,
            result.stall_ms,
        )
        return response


def _stream_call(e: slot_publish.Engine, token: str, plan: TransferPlan, req, stage_dir) -> tuple:
    """(utility, *args) that has engine `e`'s workers receive the stream: markers in this
    server's stage, or for an engine on another host in a directory on its own host."""
    if e.remote:
        return ("art_stage_base_relayed", token, plan.to_json(), req.version, req.digest, e.dp_rank)
    markers = str(staging.marker_dir(stage_dir, e.dp_rank))
    return ("art_stage_base_update", token, plan.to_json(), req.version, markers, req.digest)
