"""Worker side of a full-weight (base) update: stage off the step loop, write in place between
two steps, put the previous weights back when told to.

- `stage`: on the worker's staging thread (`stager`), read the update's safetensors files
  (the stage directory the API server wrote, in the served model's Hugging Face names) into
  host memory, then leave `ready.<rank>` / `failed.<rank>` in the marker directory
  (`art_vllm_plugin.staging`). Nothing the model uses is touched. Files and streams alike
  keep a progress record there while they stage (`stage_progress`: bytes and tensors so
  far), from which the API server's deadline is measured.
- `stage` of a stream (the source is a transfer plan, `art_protocol.weight_transfer`): receive
  the trainer's stream through the weight-transfer engine vLLM built
  from `--weight-transfer-config`, retargeted at a sink instead of the model
  (`set_weight_update_target`), so any engine that delivers through `model.load_weights`
  (vLLM's NCCL and IPC engines, `art_gloo` here) stages instead of writing live weights; the
  sink keeps only this worker's shard, in the parameters' loaded form (`shard_stage`), and
  its commit is a copy where the served form is that form (`shard_commit`). The
  ready marker carries the digest of what arrived, which the API server compares across
  workers and with the request; a NaN, a tensor missing or a digest that does not match is a
  refusal (`adapter` kind: 422). Where: an engine of one worker receives on the worker's
  stream-receiving thread (a lane of its own: LoRA stages never wait behind a trainer's
  stream) while serving goes on, as its forward runs no collective. An engine of several
  workers receives between steps: in the stage ride itself, which every worker runs at the
  same step before the forward (or in the same RPC when the engine is idle), so the stream's
  collectives and the forward's tensor- and pipeline-parallel ones run in one order on every
  worker and never at the same time (two communicators' collectives issued in different
  orders on two ranks is a known NCCL deadlock); that engine's steps wait for the stream.
- `commit_locked`: between two steps, under the weights lock a forward also holds (a ride:
  `step_rides`), write the staged tensors into the model in place through vLLM's layerwise
  reload (`compat.reload_weights_in_place`: the model's own `load_weights`, then each layer's
  weight processing again, inside vLLM's config context with the runner's config, as vLLM's
  own reloads run). LoRA slots stay as they are: their stacked tensors are separate from the
  base weights, and the reset that vLLM's `reload_weights` adds is not called. A failure,
  even inside `load_weights` in the middle of a layer, is undone before anything else (every
  layer vLLM's reload left armed gets its own tensors and a clean reload state back), then
  the previous weights are written back, whole, before it answers.
- `rollback_locked`: puts back the previous weights of a commit that another worker or
  engine failed (all or nothing).

The undo is *where the previous weights can be read again*, not a copy of them: the served
model's own files (read as vLLM loaded them) for the start weights, else the directory of the
previous full-weight version, which the API server keeps while it is current
(`api_server/base_updates.py`), else, when the current version came as a stream, the shard
it was staged in, which the worker keeps while that version is current (the stream left no
files anywhere: this worker's shard in host memory is the price). Why not a
copy of the parameters: on CPU (and for quantized models) the live tensors are processed
forms (packed GEMM weights), which cannot be written back as they are; a reload from
checkpoint-format tensors always can. Cost: a revert reads the previous weights again (a
failure path only); a host copy of the update's tensors lives from its stage to its commit.
"""

from __future__ import annotations

import functools
import json

from art_protocol.checkpoint_layout import checkpoint_files
from art_protocol.weights_digest import WeightsDigest
from art_vllm_plugin import compat, stage_progress, staging
from art_vllm_plugin.compat import shard_forms
from art_vllm_plugin.tensor_checks import all_finite
from art_vllm_plugin.worker import shard_commit, shard_stage, write_probes
from art_vllm_plugin.worker.stager import STREAM, stage_in_background
from art_vllm_plugin.worker.state import BaseUndo, StagedBase, worker_state


def read_dir(checkpoint_dir: str):
    """(name, tensor) of every tensor of a safetensors checkpoint directory, a file at a time."""
    from safetensors.torch import load_file

    for path in checkpoint_files(checkpoint_dir):
        yield from load_file(str(path)).items()


def _stage(worker, staged: StagedBase, stage_dir: str, marker_dir: str, rank: int) -> None:
    try:
        state = worker_state(worker)
        if state.fault == "stage":
            state.fault = None
            raise RuntimeError(f"injected staging failure on rank {rank} (test hook)")
        progress = stage_progress.Recorder(marker_dir, rank)
        tensors = {}
        for name, tensor in read_dir(stage_dir):  # a file at a time
            tensors[name] = tensor
            progress.add(tensor.nbytes)
        progress.write()
        staged.tensors = tensors
        ok, message = True, ""
    except BaseException as exc:  # reported through the marker; the worker keeps serving
        staged.error = f"{type(exc).__name__}: {exc}"
        ok, message = False, f"engine\n{staged.error}"
    staging.mark(marker_dir, rank, ok, message)


class _ShardSink:
    """Stands in for the model as a weight-transfer engine's target: hands each checkpoint
    tensor to this worker's shard stage (`shard_stage.ShardStage`), which keeps only the
    slice this worker's parameters hold, and counts it in the worker's progress record
    (`stage_progress`: the API server's stall deadline and `GET /art/v1/weights` read it),
    whatever engine delivers it. With `verify` it also digests each tensor and checks its
    values: for engines that do not (vLLM's NCCL and IPC engines); the plugin's own
    (`verifies_delivered`: art_gloo, art_nixl) did both already, on the bytes they received,
    and say the digest themselves (`received_digest`), so the work is not done twice."""

    def __init__(self, stage, progress: stage_progress.Recorder | None = None, verify=True):
        self.stage = stage
        self.progress = progress
        self.verify = verify
        self.digest = WeightsDigest()
        self.problems: list[str] = []

    def load_weights(self, weights):
        import torch

        for name, tensor in weights:
            if self.verify:
                # Device tensors (NCCL, IPC) live in buffers the engine reuses; the digest
                # reads a host copy of each, dropped once the shard took its slice.
                host = tensor if tensor.device.type == "cpu" else tensor.detach().to("cpu")
                host = host.contiguous()
                data = host.view(torch.uint8).numpy() if host.numel() else b""
                self.digest.update(name, str(host.dtype), tuple(host.shape), data)
                if not all_finite(host):
                    self.problems.append(f"{name}: holds NaN or infinite values")
            self.stage.load_weights([(name, tensor)])
            if self.progress is not None:
                self.progress.add(tensor.numel() * tensor.element_size())
        return self.stage.names


def _received_digest(engine, sink: _ShardSink) -> str:
    """The digest of what arrived: the sink's, or the engine's where it verified."""
    if sink.verify:
        return sink.digest.hexdigest()
    return engine.received_digest


def stream_update_info(engine, plan: dict, digest: str | None) -> dict:
    """The engine's update info for a plan: vLLM's (`names`, `dtype_names`, `shapes`), plus
    `round` and `digest` where the engine's info takes them (`art_gloo`)."""
    info = {"names": plan["names"], "dtype_names": plan["dtypes"], "shapes": plan["shapes"]}
    fields = getattr(engine.update_info_cls, "__dataclass_fields__", {})
    info.update({k: v for k, v in (("round", plan["round"]), ("digest", digest)) if k in fields})
    return info


def _problems(plan: dict, sink: _ShardSink, digest: str | None, got: str) -> list[str]:
    names = sink.stage.names
    problems = [f"{name}: not received" for name in plan["names"] if name not in names]
    problems += sink.problems
    problems += [f"{p}: no tensor of the stream was loaded into it" for p in sink.stage.unwritten()]
    if names and len(sink.stage.ignored) == len(names):
        problems.append(
            f"the model's loaders took nothing of any of the {len(names)} tensors received "
            "(nothing would change)"
        )
    if digest is not None and got != digest:
        problems.append(f"the digest of what arrived ({got}) is not the request's {digest}")
    return problems


def _stage_stream(worker, staged: StagedBase, plan: dict, digest, marker_dir: str, rank: int):
    engine = compat.worker_weight_transfer_engine(worker)
    if engine is None:
        staged.error = (
            "this server has no weight-transfer engine: serve with --weight-transfer-config "
            '(e.g. \'{"backend": "art_gloo"}\') to receive streamed full-weight updates'
        )
        staging.mark(marker_dir, rank, False, f"engine\n{staged.error}")
        return
    refused = None
    try:
        progress = stage_progress.Recorder(marker_dir, rank)
        verify = not getattr(engine, "verifies_delivered", False)
        sink = _ShardSink(shard_stage.ShardStage(*staging_layout(worker)), progress, verify)
        model_config = compat.worker_model_runner(worker).vllm_config.model_config
        engine.set_weight_update_target(sink, model_config)
        try:
            info = stream_update_info(engine, plan, digest)
            engine.receive_weights(engine.parse_update_info(info))
        finally:
            engine.reset_weight_update_target()
            sink.stage.seal()
            progress.write()
        got = _received_digest(engine, sink)
        problems = _problems(plan, sink, digest, got)
        if problems:
            refused = "; ".join(problems)
    except ValueError as exc:  # the stream broke its plan (`gloo_transfer.StreamRefused`)
        refused = str(exc)
    except BaseException as exc:  # the transport failed; the worker keeps serving
        staged.error = f"{type(exc).__name__}: {exc}"
        staging.mark(marker_dir, rank, False, f"engine\n{staged.error}")
        return
    if refused is not None:
        staged.error = refused
        staging.mark(marker_dir, rank, False, f"adapter\n{refused}")
        return
    staged.shard = sink.stage
    staged.tensors = {}
    staged.streamed = True
    ready = {
        "digest": got,
        "staged_bytes": sink.stage.nbytes,
        "ignored": sink.stage.ignored,
    }
    staging.mark(marker_dir, rank, True, json.dumps(ready))


def stage(worker, token: str, source, marker_dir: str, digest: str | None = None) -> None:
    """Start staging the update: `source` is the stage directory (files), or a transfer plan
    (`TransferPlan.to_json()`: a stream, checked against `digest` when given); the marker
    goes to `marker_dir`."""
    rank = compat.worker_rank(worker)
    staged = worker_state(worker).staged_base[token] = StagedBase()
    if isinstance(source, dict):
        job = functools.partial(_stage_stream, worker, staged, source, digest, marker_dir, rank)
        if compat.workers_per_engine(worker) > 1:
            job()  # between steps (see the module docstring)
        else:
            stage_in_background(worker, job, STREAM)
    else:
        job = functools.partial(_stage, worker, staged, source, marker_dir, rank)
        stage_in_background(worker, job)


def _write_back(worker, undo: BaseUndo) -> str | None:
    """Write the weights `undo` says the commit replaced back in place; None, or why that
    failed."""
    try:
        if undo.held is not None:  # the previous streamed version's shard, kept here
            shard_commit.commit(worker, undo.held)
            return None
        if undo.previous_dir is not None:
            weights, where = read_dir(undo.previous_dir), undo.previous_dir
        else:
            weights, where = compat.served_weights(worker), "the served model's files"
        compat.reload_weights_in_place(worker, write_probes.probed(worker, weights))
        return None
    except Exception as exc:
        if undo.held is not None:
            where = "the previous stream's shard (held in host memory)"
        return f"writing back the weights of {where} failed: {type(exc).__name__}: {exc}"


def commit_locked(worker, token: str, label: str | None, previous_dir: str | None) -> dict:
    """The in-place write, for a caller holding the weights lock. `label`: the policy label of
    the weights after it; `previous_dir`: where the weights it replaces can be read again."""
    state = worker_state(worker)
    rank = compat.worker_rank(worker)
    staged = state.staged_base.pop(token, None)
    if staged is None or staged.tensors is None:
        error = (staged and staged.error) or "nothing staged for this update"
        return {"ok": False, "rank": rank, "error": error, "restored": True}
    undo = BaseUndo(previous_dir, state.label, state.held_base)
    fault = state.fault == "commit"  # test hook: fail inside the write (`write_probes`)
    if fault:
        state.fault = None
    try:
        if staged.shard is not None:  # a stream: this worker's shard (`shard_commit`)
            shard_commit.commit(worker, staged.shard, fail_after_first=fault)
        else:
            weights = write_probes.probed(worker, staged.tensors, fail_mid_layer=fault)
            compat.reload_weights_in_place(worker, weights)
    except Exception as exc:
        return {
            "ok": False,
            "rank": rank,
            "error": f"{type(exc).__name__}: {exc}",
            "restored": _write_back(worker, undo) is None,
        }
    if label is not None:
        state.label = label
    # A streamed version can only be read again from here: keep its shard while current.
    state.held_base = staged.shard if staged.streamed else None
    state.undo_base[token] = undo
    return {"ok": True, "rank": rank}


def rollback_locked(worker, token: str) -> dict:
    """Put back what the commit of `token` replaced here; the caller holds the weights lock."""
    state = worker_state(worker)
    rank = compat.worker_rank(worker)
    undo = state.undo_base.pop(token, None)
    if undo is None:
        return {"ok": True, "rank": rank, "restored": False}  # nothing was committed here
    if (error := _write_back(worker, undo)) is not None:
        return {"ok": False, "rank": rank, "error": error}
    state.label = undo.label
    state.held_base = undo.held
    return {"ok": True, "rank": rank, "restored": True}


def staging_layout(worker) -> tuple:
    """(model, layout, pinned) of this worker's shard stages, the layout made once
    (`shard_stage.layout`): pinned host memory where the platform has CUDA."""
    state = worker_state(worker)
    model = compat.worker_model_runner(worker).get_model()
    if state.shard_layout is None:
        state.shard_layout = shard_stage.layout(model)
    return model, state.shard_layout, not compat.is_cpu_platform()


def art_base_staging(self) -> dict:
    """What a streamed version costs this worker, known before a byte moves: its shard's bytes
    (`shard_bytes`), the held undo's (`held_bytes`: the current version's shard when it came
    as a stream), where it is staged, and the path its commit takes per module (`commit`:
    modules copied, modules rebuilt, and why). Read by the API server's staging budget and by
    `GET /art/v1/weights`."""
    with worker_state(self).weights_lock:
        _model, entries, pinned = staging_layout(self)
        held = worker_state(self).held_base
        modules: dict[int, tuple] = {}
        for e in entries:
            modules.setdefault(id(e.module), (e.module, {}))[1][e.name] = e.spec
        chosen = {k: shard_forms.plain_copy_applies(m, specs) for k, (m, specs) in modules.items()}
        return {
            "rank": compat.worker_rank(self),
            "staging": "pinned host" if pinned else "host",
            "shard_bytes": shard_stage.layout_bytes(entries),
            "held_bytes": 0 if held is None else held.nbytes,
            "commit": shard_commit.describe(
                {
                    k: (shard_commit.COPY if ok else shard_commit.REBUILD, why)
                    for k, (ok, why) in chosen.items()
                }
            ),
        }


def art_rollback_base_update(self, token: str) -> dict:
    """RPC form of `rollback_locked` (an engine reverting after another engine failed)."""
    with worker_state(self).weights_lock:
        return rollback_locked(self, token)
