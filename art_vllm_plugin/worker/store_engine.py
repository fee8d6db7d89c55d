"""What the plugin's two weight-transfer engines (`art_gloo`, `art_nixl`) share: a worker's
rank in the trainer's group, the client of the trainer's `TCPStore` (their control plane),
vLLM's own routes (layerwise reload straight into the model), and delivery through
`model.load_weights`, which ART's staged update retargets at its shard sink
(`worker/base_weights.py`). Each engine adds only how the bytes move.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch

from art_vllm_plugin import compat


@dataclass
class StoreInitInfo:
    """`init_info` of `POST /art/v1/weights/transfer/init`: the trainer's store, the group's
    size (the trainer and every worker of every engine), this group's first worker rank."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    timeout_s: float = 600.0


def transfer_rank(parallel, rank_offset: int, world_size: int) -> int:
    """This worker's rank in the trainer's transfer group: `rank_offset + dp_index *
    workers_per_engine + worker rank`, as vLLM's NCCL engine numbers them (the trainer is 0)."""
    rank = rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
    if not 0 < rank < world_size:
        raise ValueError(
            f"worker rank {rank} in the weight-transfer group does not fit world_size "
            f"{world_size} (the trainer is rank 0; every worker of every engine needs a rank)"
        )
    return rank


def trainer_store(init_info: StoreInitInfo) -> torch.distributed.TCPStore:
    """A client of the trainer's store (the trainer hosts it)."""
    return torch.distributed.TCPStore(
        init_info.master_address,
        init_info.master_port,
        is_master=False,
        timeout=datetime.timedelta(seconds=init_info.timeout_s),
    )


class StoreWeightTransferEngine(compat.weight_transfer_engine_base()):
    """The shared part of both engines (see the module docstring)."""

    supports_draft_weight_update = False
    #: Each engine digests what it receives and checks its values before delivering it, and
    #: keeps the digest of the last stream it received (`received_digest`): ART's staging
    #: sink need not do either again (`base_weights._ShardSink`).
    verifies_delivered = True
    received_digest: str | None = None

    def start_weight_update(self) -> None:
        """vLLM's own route: layerwise reload straight into the model (no staging)."""
        compat.initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        compat.finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:
        """As the base class, without its device synchronize: art_gloo moves host tensors
        synchronously, art_nixl's receiver synchronizes its device after each bucket, and a
        CPU host has no accelerator to synchronize."""
        self.receive_weights(self.parse_update_info(update_info))

    def deliver(self, name: str, tensor: torch.Tensor) -> None:
        """Hand one received tensor to the model's loader (or the sink it was retargeted at)."""
        self.model.load_weights([(name, tensor)])

    def not_initialized(self, backend: str) -> RuntimeError:
        return RuntimeError(
            f"the {backend} weight transfer is not initialized: POST "
            "/art/v1/weights/transfer/init first"
        )
