"""Keep one version of a model's full weights where the user says, to send it while the next
step trains.

Why: a trainer that publishes a version in the background (the next step trains meanwhile)
must send the weights *as they were* at the version, not as the optimizer is changing them,
and may need them again for a retry. The example's first streamed path kept a pageable host
copy of the whole model on rank 0 (`publisher._snapshot_full`): for a 70B model that is 141 GB
of host memory per node per version, copied at 1.4 GB/s. Where the copy lives is the user's
choice, made once (`KeepWhere`), never a silent default:

- `"device"`: a copy beside the parameters (GPU spare memory on a GPU trainer: a
  device-to-device copy, no host memory; the parameters' own memory on a CPU trainer);
- `"pinned_host"`: page-locked host memory, filled by asynchronous copies (the fast path to
  the host on a GPU; a CPU trainer has no device to pin for, and gets plain host memory);
- `"files"`: the version written as a checkpoint directory (`write_hf_checkpoint`), read back
  a shard at a time when sent: the only kind that holds nothing in memory.

`keep_version` is collective like `stream_hf_weights` (every TP/EP/DP rank calls it); only the
sending rank keeps anything. `KeptVersion.produce(sink)` hands the kept tensors to a sink in
stream order (e.g. `GlooWeightSender.send`'s producer), from any thread, with no collective.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from art_megatron_ext.weights.hf_checkpoint import write_hf_checkpoint
from art_megatron_ext.weights.hf_stream import StreamReceipt, stream_hf_weights

KeepWhere = Literal["device", "pinned_host", "files"]
KEEP_WHERE: tuple[str, ...] = ("device", "pinned_host", "files")


@dataclass
class KeptVersion:
    """One version's full weights as the sending rank kept them (empty on the other ranks)."""

    where: str
    receipt: StreamReceipt
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # device / pinned_host
    path: Path | None = None  # files

    @property
    def digest(self) -> str | None:
        return self.receipt.digest

    def resident_bytes(self) -> int:
        """Bytes this version holds in memory (0 for files)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def plan(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, dtype, shape) of every kept tensor in stream order, without reading a
        tensor's bytes (files: from the shards' headers)."""
        if self.path is None:
            return [(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]
        from art_protocol.checkpoint_layout import checkpoint_files, raw_header
        from art_protocol.weights_digest import SAFETENSORS_DTYPES

        out = []
        for shard in checkpoint_files(self.path):
            header, _ = raw_header(shard)
            out += [
                (n, getattr(torch, SAFETENSORS_DTYPES[e["dtype"]]), tuple(e["shape"]))
                for n, e in header.items()
                if n != "__metadata__"
            ]
        return out

    def produce(self, sink: Callable[[str, torch.Tensor], None]) -> None:
        """Hand every kept tensor to `sink(name, tensor)`, in stream order. Files are read a
        shard at a time (one layer's tensors in memory)."""
        if self.path is None:
            for name, tensor in self.tensors.items():
                sink(name, tensor)
            return
        from safetensors.torch import load_file

        from art_protocol.checkpoint_layout import checkpoint_files

        for shard in checkpoint_files(self.path):
            for name, tensor in load_file(str(shard)).items():
                sink(name, tensor)

    def release(self) -> None:
        """Drop the kept tensors (files stay: they are the version's record)."""
        self.tensors = {}


def _copy_for(where: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if where == "device":
        return lambda t: t.detach().clone()
    pin = torch.cuda.is_available()

    def to_host(t: torch.Tensor) -> torch.Tensor:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin and t.device.type == "cuda")
        host.copy_(t, non_blocking=host.is_pinned())
        return host

    return to_host


def keep_version(
    model: torch.nn.Module,
    shape,
    where: KeepWhere,
    *,
    out_dir: str | Path | None = None,
    send: bool | None = None,
) -> KeptVersion:
    """Keep `model`'s full weights in HF names where `where` says (module docstring).
    Collective: call it on every rank, as `stream_hf_weights`; `send` picks the keeping rank
    (default global rank 0). `out_dir` is the version's directory for `"files"` (required there,
    refused elsewhere). Raises `ValueError` naming a bad `where` before anything is copied."""
    if where not in KEEP_WHERE:
        raise ValueError(f"keep where={where!r}: choose one of {', '.join(KEEP_WHERE)}")
    if (where == "files") != (out_dir is not None):
        raise ValueError(
            "keep where='files' needs out_dir (the version's checkpoint directory); "
            f"where={where!r} keeps it in memory and takes no out_dir"
        )
    if where == "files":
        receipt = write_hf_checkpoint(model, shape, out_dir, send=send)
        return KeptVersion(where, receipt, path=Path(out_dir) if receipt.digest else None)
    copy = _copy_for(where)
    kept: dict[str, torch.Tensor] = {}
    receipt = stream_hf_weights(model, shape, lambda n, t: kept.__setitem__(n, copy(t)), send=send)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the asynchronous host copies have landed
    return KeptVersion(where, receipt, tensors=kept)
