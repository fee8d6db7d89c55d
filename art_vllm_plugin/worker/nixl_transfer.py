"""`art_nixl`: a vLLM weight-transfer engine on NIXL, for full-weight updates at link speed.

Why: `art_gloo` runs anywhere but moves every byte through a TCP tree of host copies. Here
the trainer registers a few bucket buffers with a NIXL agent once (GPU memory on a GPU trainer,
host memory on a CPU one, `art_megatron_ext.weights.NixlWeightSender`) and each worker READs
each bucket straight out of them into one receive buffer of its own (on its GPU where it has
one), one-sided: UCX picks the path (NVLink, RDMA, shared memory, TCP). Registered with vLLM's
factory like `art_gloo` (`compat.register_weight_transfer_engine`) and selected the same way:
`vllm serve ... --weight-transfer-config '{"backend": "art_nixl"}'`.

The control plane is the trainer's `TCPStore` (ready keys, one small record per bucket, a
counter per bucket the workers add to once they read it), the handshake `art_gloo`'s: a
worker sets its ready key once receiving and the trainer moves nothing before every key is
there, so a refusal before the receive reaches the trainer with nothing sent. Rules:
`art_protocol.weight_transfer` (section `art_nixl`); the wire itself, without vLLM, is
`worker/nixl_receiver.py`.

Two users, as for `art_gloo`: ART's staged update (the engine's target retargeted at the
shard sink, `worker/base_weights.py`), and vLLM's own `/start_weight_update`,
`/update_weights`, `/finish_weight_update` (layerwise reload straight into the model).
"""

from __future__ import annotations

from dataclasses import dataclass

from art_protocol.weight_transfer import NIXL_BACKEND
from art_vllm_plugin.worker.gloo_transfer import GlooUpdateInfo
from art_vllm_plugin.worker.store_engine import (
    StoreInitInfo,
    StoreWeightTransferEngine,
    trainer_store,
    transfer_rank,
)


@dataclass
class NixlInitInfo(StoreInitInfo):
    """`init_info` of `POST /art/v1/weights/transfer/init` for this engine: the store's, and how
    long a worker waits for the next bucket before it ends the stream (`stall_timeout_s`)."""

    stall_timeout_s: float = 120.0


@dataclass
class NixlUpdateInfo(GlooUpdateInfo):
    """One stream: the plan (`names`, `dtype_names`, `shapes`), its `round`, and the
    request's `digest` when it named one (as `art_gloo`'s)."""


class ArtNixlWeightTransferEngine(StoreWeightTransferEngine):
    """The worker side of `art_nixl` (see the module docstring)."""

    init_info_cls = NixlInitInfo
    update_info_cls = NixlUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver = None

    def init_transfer_engine(self, init_info: NixlInitInfo) -> None:
        """Reach the trainer's store, make this worker's agent, add the trainer's, and register
        one receive buffer of the trainer's bucket size (NIXL is imported here, not before:
        a server that never streams over art_nixl never loads it)."""
        from art_vllm_plugin.worker.nixl_receiver import NixlReceiver

        rank = transfer_rank(self.parallel_config, init_info.rank_offset, init_info.world_size)
        store = trainer_store(init_info)
        self.shutdown()  # a second init (a new trainer) replaces the first
        workers = init_info.world_size - init_info.rank_offset
        self.receiver = NixlReceiver(store, rank, workers, self.device, init_info.stall_timeout_s)

    def receive_weights(self, update_info: NixlUpdateInfo) -> None:
        if self.receiver is None:
            raise self.not_initialized(NIXL_BACKEND)
        self.received_digest = None
        self.received_digest = self.receiver.receive(update_info, self.deliver)

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
