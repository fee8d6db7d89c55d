"""A worker's end of a streamed LoRA update: receive the adapter's tensors through the
weight-transfer engine and, on the one worker the API server names, write them as the
adapter's safetensors file beside the config it wrote.

Why write a file: from there the update is a push (`api_server/adapter_stream.py`): the API
server validates and digests the files, keeps a copy for exact leases, and every worker
stages them with vLLM's own loader, so a streamed version is checked, served, labelled and
leased exactly as one that came as files. Every worker receives the stream, because both
engines' transfers are collective over the trainer's group (`art_gloo` broadcasts to every
member; `art_nixl`'s trainer waits for every worker's read); the others drop what arrived.
An adapter is small next to the model (megabytes to a few hundred), so the extra read costs
little next to a step.

Where: as a full-weight stream (`base_weights.stage`): an engine of one worker receives on
the worker's stream thread while serving goes on; an engine of several workers receives
between steps, in the ride itself, so the stream's collectives never overlap the forward's.
The outcome is the worker's marker in the API server's marker directory, `adapter` kind for
a stream that broke its plan (422), `engine` for a transport failure (500).
"""

from __future__ import annotations

import functools
from pathlib import Path

from art_protocol.digest import WEIGHTS_FILE
from art_vllm_plugin import compat, staging
from art_vllm_plugin.worker.base_weights import stream_update_info
from art_vllm_plugin.worker.stager import STREAM, stage_in_background


class _Keep:
    """The engine's target: a host copy of each tensor (engines reuse their buffers)."""

    def __init__(self, keep: bool):
        self.keep = keep
        self.tensors: dict = {}
        self.names: list[str] = []

    def load_weights(self, weights):
        for name, tensor in weights:
            self.names.append(name)
            if self.keep:
                self.tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()
        return self.names


def receive(worker, token: str, plan: dict, marker_dir: str, write_dir: str | None) -> None:
    """Start receiving the stream of `plan`; `write_dir`: where the engine's worker 0 writes
    the adapter's weights file (None, and on every other worker: what arrives is dropped)."""
    rank = compat.worker_rank(worker)
    write_dir = write_dir if rank == 0 else None
    job = functools.partial(_receive, worker, plan, marker_dir, write_dir, rank)
    if compat.workers_per_engine(worker) > 1:
        job()  # between steps (see the module docstring)
    else:
        stage_in_background(worker, job, STREAM)


def _receive(worker, plan: dict, marker_dir: str, write_dir: str | None, rank: int) -> None:
    engine = compat.worker_weight_transfer_engine(worker)
    if engine is None:
        staging.mark(
            marker_dir,
            rank,
            False,
            "engine\nthis server has no weight-transfer engine: serve with "
            '--weight-transfer-config (e.g. \'{"backend": "art_nixl"}\') to receive streamed '
            "updates",
        )
        return
    sink = _Keep(write_dir is not None)
    try:
        model_config = compat.worker_model_runner(worker).vllm_config.model_config
        engine.set_weight_update_target(sink, model_config)
        try:
            info = stream_update_info(engine, plan, None)
            engine.receive_weights(engine.parse_update_info(info))
        finally:
            engine.reset_weight_update_target()
        missing = sorted(set(plan["names"]) - set(sink.names))
        if missing:
            raise ValueError(f"{missing[0]}: not received ({len(missing)} tensors missing)")
        if write_dir is not None:
            _write(Path(write_dir) / WEIGHTS_FILE, sink.tensors)
    except ValueError as exc:  # the stream broke its plan, or what arrived is no adapter
        staging.mark(marker_dir, rank, False, f"adapter\n{exc}")
        return
    except BaseException as exc:  # the transport failed; the worker keeps serving
        staging.mark(marker_dir, rank, False, f"engine\n{type(exc).__name__}: {exc}")
        return
    staging.mark(marker_dir, rank, True)


def _write(path: Path, tensors: dict) -> None:
    """The weights file, as safetensors writes it (its own order: dtype, then name)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})
