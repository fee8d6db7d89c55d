"""Export each version after the step, publish it from rank 0 while the next step trains.

`export_ready` is collective over the data-parallel group: every rank finishes the LoRA
parameter all-gather that `overlap_param_gather` holds back until the next forward (otherwise
the shards other ranks own would be stale in the export), rank 0 writes the version atomically
(temp dir, fsync, rename, manifest with the content digest). Rank 0 alone then publishes it in
flight on a background thread (`BackgroundPublisher` + `post_update`, digest included), so the
optimizer checkpoint is written while the server loads the version. With `--push` the
version's files travel in the request (`ArtClient.update_from_dir`) instead of its path.
`latest` is the newest version published or in flight: what the rollout workers validate span
versions against.

With `--update full` every rank takes part in the full-weight export instead: each finishes the
deferred parameter all-gather (`start_param_sync(force_sync=True)`, as Megatron does before a
checkpoint), rank 0 writes RUN_DIR/weights/v<N> a layer a shard (`write_hf_checkpoint`), and
publishes it as the server's new base weights (`ArtClient.update_weights`, the digest of what
it wrote included). With `--transport gloo` nothing is written: rank 0 takes a host copy of the
weights in the served model's names (`stream_hf_weights`, a layer at a time) and streams it to
the server's workers on the background thread (`GlooWeightSender`, connected on the first
publish at `cfg.trainer_host`, the address the workers reach the trainer at), so the server
needs no access to the trainer's files. A LoRA version streams the same way with `--transport`
(`peft_adapter` in rank 0's memory, `send_adapter`): no file, no HTTP body.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from loop_config import LoopConfig


@dataclasses.dataclass(frozen=True)
class FullReady:
    """A full-weight export on disk (`--update full`)."""

    path: Path
    version: int
    digest: str | None  # the writing rank's; None on the others (they never hash)


@dataclasses.dataclass(frozen=True)
class StreamReady:
    """A full-weight version kept for its stream (`--update full --transport gloo`): a
    `KeptVersion` where `--stream-keep` says, which the next step's training does not touch."""

    kept: object  # art_megatron_ext.weights.KeptVersion
    version: int

    @property
    def digest(self) -> str | None:
        return self.kept.digest


@dataclasses.dataclass(frozen=True)
class AdapterStreamReady:
    """A LoRA version in rank 0's memory for its stream (`--transport gloo|nixl`): the
    adapter's tensors in PEFT's names and its config, as `export_peft` would write them."""

    slot: str
    version: int
    tensors: dict
    config: dict

    def plan(self) -> list[tuple]:
        return [(name, t.dtype, tuple(t.shape)) for name, t in self.tensors.items()]

    def produce(self, sink) -> None:
        for name, tensor in self.tensors.items():
            sink(name, tensor)


#: Workers of the example's server (one engine, one worker): every one joins the group.
SERVER_WORKERS = 1


class Publisher:
    def __init__(self, url: str | None, cfg: LoopConfig, shape=None):
        """`url`: the server's, on rank 0; None on the other ranks (they only export).
        `shape`: the model's `GptShape` (the full-weight export names tensors by it)."""
        from art_megatron_ext.lora.publish_ready import BackgroundPublisher, post_update

        self.cfg = cfg
        self.shape = shape
        self._background = None
        if url is not None:
            if cfg.streamed:
                self._post = self._streamer(url, cfg.trainer_host, cfg.transport)
            elif cfg.full:
                self._post = self._full_poster(url)
            else:
                self._post = self._pusher(url) if cfg.push else post_update(url)
            self._background = BackgroundPublisher(self._publish)
        self._pending = None
        self._t_trained = 0.0
        self.latest = 0
        self.published = 0
        self.last_ms = 0.0

    @staticmethod
    def _pusher(url: str):
        from art_protocol.client import ArtClient

        def push(ready) -> dict:
            with ArtClient(url, timeout=300) as art:
                return art.update_from_dir(
                    ready.slot, ready.path, ready.version, digest=ready.digest
                )

        return push

    @staticmethod
    def _full_poster(url: str):
        from art_protocol.client import ArtClient

        def post(ready: FullReady) -> dict:
            with ArtClient(url, timeout=300) as art:
                return art.update_weights(str(ready.path), ready.version, digest=ready.digest)

        return post

    @staticmethod
    def _streamer(url: str, host: str, transport: str):
        """Streams each version over the weight-transfer group of `transport` ("gloo":
        art_gloo, "nixl": art_nixl), opened on the first publish at `host` (`cfg.trainer_host`:
        the address the server's workers reach this process at)."""
        from art_megatron_ext.weights import GlooWeightSender, NixlWeightSender
        from art_protocol.client import ArtClient

        art = ArtClient(url, timeout=300)
        sender = None
        kind = {"gloo": GlooWeightSender, "nixl": NixlWeightSender}[transport]

        def stream(ready: StreamReady | AdapterStreamReady) -> dict:
            nonlocal sender
            if sender is None:
                sender = kind.connect(art, workers=SERVER_WORKERS, host=host, timeout_s=300)
            if isinstance(ready, AdapterStreamReady):
                return sender.send_adapter(
                    ready.slot, ready.version, ready.config, ready.plan(), ready.produce
                )
            plan = ready.kept.plan()
            try:
                return sender.send(ready.version, plan, ready.kept.produce, digest=ready.digest)
            finally:
                ready.kept.release()

        return stream

    def _snapshot_full(self, ddp, version: int) -> StreamReady:
        """Collective as `_export_full`; rank 0 keeps the version where `--stream-keep` says
        (`keep_version`: beside the parameters, in pinned host memory, or as files), never a
        pageable host copy of the whole model by default."""
        import torch

        from art_megatron_ext.weights import keep_version

        ddp.start_param_sync(force_sync=True)
        lead = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        where = self.cfg.stream_keep
        out = self.cfg.path / "weights" / f"v{version}" if where == "files" else None
        kept = keep_version(ddp.module, self.shape, where, out_dir=out, send=lead)
        return StreamReady(kept, version)

    def _snapshot_lora(self, model, version: int) -> AdapterStreamReady:
        """Collective: every rank finishes the LoRA parameters' all-gather, rank 0 keeps the
        adapter in memory (`peft_adapter`); nothing is written."""
        from art_megatron_ext.lora import peft_adapter

        tensors, config = peft_adapter(model, self.cfg.slot, self.cfg.hf_model)
        return AdapterStreamReady(self.cfg.slot, version, tensors, config)

    def _export_full(self, ddp, version: int) -> FullReady:
        """Collective: every rank finishes the parameter all-gather and streams; rank 0 writes."""
        import torch

        from art_megatron_ext.weights import write_hf_checkpoint

        ddp.start_param_sync(force_sync=True)
        out = self.cfg.path / "weights" / f"v{version}"
        lead = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        receipt = write_hf_checkpoint(ddp.module, self.shape, out, send=lead)
        return FullReady(out, version, receipt.digest)

    def _publish(self, ready) -> dict:
        full = isinstance(ready, FullReady | StreamReady)
        if not full and self.cfg.publish_slot != ready.slot:
            # the broken-loop test's wrong slot
            ready = dataclasses.replace(ready, slot=self.cfg.publish_slot)
        receipt = self._post(ready)
        self.published = ready.version
        self.last_ms = (time.monotonic() - self._t_trained) * 1000
        return receipt

    def start(self, model, version: int, t_trained: float) -> None:
        """Collective: export `version` (every rank), publish it in the background (rank 0)."""
        from art_megatron_ext.lora.publish_ready import export_ready

        if self.cfg.streamed and self.cfg.full:
            ready = self._snapshot_full(model, version)
        elif self.cfg.full:
            ready = self._export_full(model, version)
        elif self.cfg.streamed:
            ready = self._snapshot_lora(model, version)
        else:
            ready = export_ready(
                model,
                self.cfg.slot,
                self.cfg.path / "adapters",
                version=version,
                step=version,
                base_model_name_or_path=self.cfg.hf_model,
            )
        self.latest = version
        self._t_trained = t_trained
        if self._background is not None:
            self._pending = self._background.submit(ready)

    def join(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()  # raises the publish's error

    def close(self) -> None:
        if self._background is not None:
            self._background.close()
