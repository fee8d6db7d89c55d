"""`art_gloo`: a vLLM weight-transfer engine over a `torch.distributed` gloo group.

Why: vLLM's own engines (NCCL, CUDA IPC) need GPUs. This one runs wherever torch does, so the
trainer-to-server stream of a full-weight update runs end to end on CPU hosts (and across
hosts without a shared file system). It is registered with vLLM's factory
(`WeightTransferEngineFactory.register_engine`, `compat.register_weight_transfer_engine`) and
selected as vLLM's are: `vllm serve ... --weight-transfer-config '{"backend": "art_gloo"}'`.

The group is the trainer (rank 0, which hosts the `TCPStore`) and every worker of every DP
engine (rank `rank_offset + dp_index * workers_per_engine + worker rank`, as vLLM's NCCL
engine numbers them). The wire is `art_protocol.weight_transfer`'s: a header per tensor (its
index in the plan, so the trainer may send in its own order, e.g. a layer at a time), the
bytes, and the stream's digest at the end, which the worker checks against what it received.

Two users:
- ART's staged update (`worker/base_weights.stage` of a plan): the engine's target is a sink
  that keeps this worker's shard of each tensor in host memory (`worker/shard_stage.py`); the
  commit writes it in place between two steps.
- vLLM's own routes (`/start_weight_update`, `/update_weights`, `/finish_weight_update`):
  layerwise reload straight into the model, as vLLM's NCCL engine does (no staging, no
  per-token versions: that is what ART's route adds).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch

from art_protocol.weight_transfer import DIGEST_BYTES, END, GLOO_BACKEND, GROUP_PREFIX, ready_key
from art_protocol.weights_digest import WeightsDigest
from art_vllm_plugin.tensor_checks import all_finite
from art_vllm_plugin.worker.store_engine import (
    StoreInitInfo,
    StoreWeightTransferEngine,
    trainer_store,
    transfer_rank,
)
from art_vllm_plugin.worker.stream_errors import StreamRefused

__all__ = ["ArtGlooWeightTransferEngine", "GlooInitInfo", "GlooUpdateInfo", "StreamRefused"]


@dataclass
class GlooInitInfo(StoreInitInfo):
    """`init_info` of `POST /art/v1/weights/transfer/init` for this engine."""


@dataclass
class GlooUpdateInfo:
    """One stream: the plan (`names`, `dtype_names`, `shapes`, as vLLM's NCCL engine names
    them) and its `round`; `digest`, when the request named one, is checked too."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    round: str
    digest: str | None = field(default=None)


def _broadcast(group, tensor: torch.Tensor) -> None:
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def receive_stream(group, store, rank: int, info: GlooUpdateInfo, sink) -> str:
    """Receive one stream, handing each tensor to `sink(name, tensor)`; its digest, once it
    matched the one sent at its end (`StreamRefused` otherwise, after the whole stream was
    read, so trainer and workers stay in step)."""
    store.set(ready_key(info.round, rank), b"1")
    digest = WeightsDigest()
    seen: set[int] = set()
    problems: list[str] = []
    header = torch.empty(1, dtype=torch.int64)
    while True:
        _broadcast(group, header)
        index = int(header[0])
        if index == END:
            break
        if not 0 <= index < len(info.names) or index in seen:
            # The sender broke the wire itself: the rest cannot be framed.
            raise StreamRefused(f"tensor index {index} is outside the plan or sent twice")
        seen.add(index)
        name = info.names[index]
        tensor = torch.empty(info.shapes[index], dtype=getattr(torch, info.dtype_names[index]))
        _broadcast(group, tensor)
        data = tensor.view(torch.uint8).numpy() if tensor.numel() else b""
        digest.update(name, str(tensor.dtype), tuple(tensor.shape), data)
        if not all_finite(tensor):
            problems.append(f"{name}: holds NaN or infinite values")
        sink(name, tensor)
    sent = torch.empty(DIGEST_BYTES, dtype=torch.uint8)
    _broadcast(group, sent)
    got = digest.hexdigest()
    problems += [f"{info.names[i]}: not sent" for i in range(len(info.names)) if i not in seen]
    if bytes(sent.tolist()).decode("ascii", "replace") != got:
        problems.append(f"the digest of what arrived ({got}) is not the one sent with it")
    if info.digest is not None and info.digest != got:
        problems.append(f"the digest of what arrived ({got}) is not the request's {info.digest}")
    if problems:
        raise StreamRefused("; ".join(problems))
    return got


class ArtGlooWeightTransferEngine(StoreWeightTransferEngine):
    """The worker side of `art_gloo` (see the module docstring)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.store = None
        self.rank: int | None = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        rank = transfer_rank(self.parallel_config, init_info.rank_offset, init_info.world_size)
        store = trainer_store(init_info)
        self.group = torch.distributed.ProcessGroupGloo(
            torch.distributed.PrefixStore(GROUP_PREFIX, store),
            rank,
            init_info.world_size,
            datetime.timedelta(seconds=init_info.timeout_s),
        )
        self.store, self.rank = store, rank

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise self.not_initialized(GLOO_BACKEND)
        self.received_digest = None
        self.received_digest = receive_stream(
            self.group, self.store, self.rank, update_info, self.deliver
        )

    def shutdown(self) -> None:
        self.group = None
        self.store = None
