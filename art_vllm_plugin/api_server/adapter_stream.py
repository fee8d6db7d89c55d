"""A LoRA slot update whose adapter the trainer streams (`transfer`, no files, no HTTP body).

Why: trainers without a file system the server sees (vLLM #48297; SkyRL #2221, #2250) can
push the adapter's files in the request (`adapter_push.py`), but a trainer that already keeps a
weight-transfer group with every worker for full weights (`art_gloo`, `art_nixl`) can send the
adapter the same way, with no serialisation on its side and nothing through the API server's
HTTP body. The body: `art_protocol.adapter_stream`.

How, in two phases:

1. *Receive.* Everything that can be refused without the tensors is refused before a byte
   moves (the trainer waits for every worker's ready key, so it sends nothing): a slot refused
   for updates (400), unknown (404), a plan or config that
   does not fit the slot (422: the same checks as a path update's, on the plan's names, dtypes
   and shapes); then engine 0 admits it as any update (a version not newer than the current
   one or another `expected_version`: 409; a retry of an operation id that committed is
   answered `replayed` from engine 0's record, `stream_body` being its body) and the
   reservation holds until the update ends; then an adapter over `--art-max-adapter-bytes`
   (413), no room in the staging directory (507). Then this server writes
   `adapter_config.json` into a fresh stage and every worker of every engine receives the
   stream (`engine_core/adapter_streams.py`, `worker/adapter_receive.py`; an engine on
   another host keeps its workers' markers on its own host: `relayed_stages`); engine 0's
   worker 0 writes the tensors as `adapter_model.safetensors` beside the config, and the
   publish relays the files to engines on other hosts as for any push. A stream that
   breaks its plan is 422, a transport failure 500; nothing changed either way.
2. *Publish.* That stage is then a push (`PushedAdapter`), and the update runs as one
   (`UpdateCoordinator.update`): the files are validated completely (values too) and
   digested, copied for exact leases, staged on every worker with vLLM's own loader, and
   committed between two steps with the policy label, spans, salts and receipts of any
   update. So a streamed version is exactly what a pushed one of the same files would be,
   digest included.

One stream at a time per API server (`stream_lock`, shared with full-weight streams): the
group carries one stream at a time.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import uuid
from pathlib import Path

from art_protocol.adapter_stream import config_bytes
from art_protocol.digest import CONFIG_FILE, WEIGHTS_FILE
from art_protocol.updates import UpdateRequest
from art_protocol.weight_transfer import TransferPlan
from art_vllm_plugin import staging
from art_vllm_plugin.adapters import AdapterError, check_layout
from art_vllm_plugin.api_server import slot_publish
from art_vllm_plugin.api_server.adapter_push import PushedAdapter
from art_vllm_plugin.api_server.update_coordinator import UpdateError

#: The receive phase's own marker directories, inside the stage (the publish phase's markers
#: go beside them, as for any stage).
RECEIVE_MARKERS = "receive"
#: Bytes a safetensors header takes per tensor at most, besides its name (dtype, shape,
#: offsets as JSON): the weights file's size is known from the plan up to this.
_HEADER_PER_TENSOR = 160


def weights_file_bytes(plan: TransferPlan) -> int:
    """An upper bound on the size of the weights file the plan's tensors make."""
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}
    sizes = zip(plan.dtypes, plan.shapes, strict=True)
    data = sum(math.prod(shape) * itemsize.get(dtype, 8) for dtype, shape in sizes)
    header = sum(len(n) + _HEADER_PER_TENSOR for n in plan.names) + 64
    return 8 + header + data


def stream_body(plan: TransferPlan, cfg: bytes) -> str:
    """A streamed adapter's body for its operation id: the plan's (`TransferPlan.body_id`)
    and the adapter's config."""
    return f"{plan.body_id()} config {hashlib.sha256(cfg).hexdigest()}"


class AdapterStreams:
    """Runs streamed LoRA updates through `coordinator` (see the module docstring)."""

    def __init__(self, coordinator, stream_lock: asyncio.Lock):
        self.coordinator = coordinator
        self.stream_lock = stream_lock

    async def update(self, req: UpdateRequest, plan: TransferPlan, config: dict) -> dict:
        """Run one streamed update to its end, in a task of its own (a client that goes away
        does not cut a receive or a commit short: as `UpdateCoordinator.update`)."""
        task = asyncio.ensure_future(self._update(req, plan, config))
        return await asyncio.shield(task)

    async def _update(self, req: UpdateRequest, plan: TransferPlan, config: dict) -> dict:
        co = self.coordinator
        co.check_push(req)
        current = co.view.slots[req.slot].version
        keeps = f"slot {req.slot!r} keeps serving version {current}; nothing was sent"
        source = Path(f"<stream of {req.slot}@{req.version}, round {plan.round}>")
        layout = {s: (spec.dtype, spec.shape) for s, spec in plan.layout().items()}
        try:
            check_layout(
                config, source, layout, req.slot, co.view.local[req.slot].reference,
                co.max_lora_rank,
            )  # fmt: skip
        except AdapterError as exc:
            raise UpdateError(422, f"{exc}; {keeps}") from exc
        cfg = config_bytes(config)
        token = uuid.uuid4().hex
        fingerprint = None
        if req.operation_id is not None:
            fingerprint = req.fingerprint(stream_body(plan, cfg))
        # Engine 0 admits before a byte moves (stale, expected_version, a replayed operation)
        # and the reservation holds through the receive into the publish.
        await co.view.ensure_registered()
        admitted = await co.admit(req, token, fingerprint)
        if not admitted["ok"]:
            return admitted["replayed"]
        keeps = f"slot {req.slot!r} keeps serving version {admitted['version']}"
        try:
            pushed = await self._received(req, plan, cfg, keeps)
        except BaseException:
            await co.note_failure(token, req.slot)
            raise
        # owns the stage from here on
        return await co.update(req, pushed, token=token, fingerprint=fingerprint)

    async def _received(
        self, req: UpdateRequest, plan: TransferPlan, cfg: bytes, keeps: str
    ) -> PushedAdapter:
        """The stage the stream was received into, as a push of its two files."""
        co = self.coordinator
        sizes = {CONFIG_FILE: len(cfg), WEIGHTS_FILE: weights_file_bytes(plan)}
        what = f"the adapter streamed as {req.slot}@{req.version}"
        async with self.stream_lock:
            try:
                co.staging.check_size(sizes, what)
                co.staging.check_space(sum(sizes.values()), what)
                stage_dir = await asyncio.to_thread(
                    staging.fill_stage,
                    co.staging,
                    req.slot,
                    req.version,
                    [],
                    lambda d: staging.write_files(d, {CONFIG_FILE: cfg}),
                    what,
                )
            except staging.StagingRefused as exc:
                raise UpdateError(exc.status, f"{exc}; {keeps}; nothing was sent") from exc
            try:
                await self._receive(stage_dir, plan, what, keeps)
            except BaseException:
                await asyncio.to_thread(staging.remove, stage_dir)
                raise
        sizes = {name: (stage_dir / name).stat().st_size for name in (CONFIG_FILE, WEIGHTS_FILE)}
        return PushedAdapter(req, stage_dir, sizes)

    async def _receive(self, stage_dir: Path, plan: TransferPlan, what: str, keeps: str) -> None:
        """Phase 1: every worker receives, engine 0's worker 0 writes the weights file."""
        co = self.coordinator
        markers = stage_dir / RECEIVE_MARKERS
        await asyncio.to_thread(markers.mkdir, 0o700)
        token = f"receive-{uuid.uuid4().hex}"
        calls = [
            _receive_call(co.engine_client, e, token, plan, markers, stage_dir) for e in co.engines
        ]
        answers = await asyncio.gather(*calls, return_exceptions=True)
        try:
            for answer in answers:
                if isinstance(answer, BaseException):
                    failure = slot_publish.engine_failure(answer, "the stream", keeps)
                    raise _as_update_error(failure)
                if not answer["ok"]:
                    raise UpdateError(answer.get("status", 500), f"{answer['error']}; {keeps}")
            ranks = [answer["ranks"] for answer in answers]
            try:
                await slot_publish.wait_staged(
                    co.engine_client, markers, co.engines, ranks, what, keeps, token
                )
            except slot_publish.PublishError as exc:
                raise _as_update_error(exc) from exc
        finally:
            if remote := [e for e in co.engines if e.remote]:
                # Their markers were on their own hosts (a lost engine took its own along).
                await slot_publish.in_background(
                    slot_publish.call_all(co.engine_client, remote, "art_drop_relayed", token)
                )
        await asyncio.to_thread(staging.remove, markers)


def _receive_call(engine_client, e, token: str, plan: TransferPlan, markers: Path, stage_dir):
    """Engine `e`'s workers receive the stream: their markers in this server's stage, or for
    an engine on another host in a directory on its own host (`relayed_stages`); engine 0's
    worker 0 writes the weights file into `stage_dir`."""
    if e.remote:
        return slot_publish.call(
            engine_client, e, "art_receive_adapter_relayed", token, plan.to_json(), e.dp_rank
        )
    return slot_publish.call(
        engine_client,
        e,
        "art_receive_adapter",
        token,
        plan.to_json(),
        str(staging.marker_dir(markers, e.dp_rank)),
        str(stage_dir) if e.dp_rank == 0 else None,
    )


def _as_update_error(exc: slot_publish.PublishError) -> UpdateError:
    return UpdateError(exc.status, exc.message)
