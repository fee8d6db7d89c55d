"""Write a Megatron GPT's full weights as a Hugging Face safetensors checkpoint, a layer a file.

Why: a full-weight update over files (`POST /art/v1/weights/update`, `ArtClient.update_weights`)
names a directory the server reads, in the served model's names. The weights arrive from
`stream_hf_weights` one layer at a time; each layer (and the embedding, and the final norm with
the output layer) is written as its own shard as soon as it is complete, with the standard
`model.safetensors.index.json`, so the peak memory stays one layer's tensors.

The directory appears whole or not at all: the shards are written into a temporary directory
beside it, which is renamed into place once the index is written. A server never reads half an
export, and an existing directory is never overwritten (each version gets its own).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from art_megatron_ext.weights.hf_stream import StreamReceipt, stream_hf_weights

INDEX_FILE = "model.safetensors.index.json"
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class _ShardWriter:
    """The sink: buffers one group of tensors (one layer, or what lies outside the layers)
    and writes it as a shard when the next group starts."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.group: str | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.weight_map: dict[str, str] = {}
        self.shards = 0
        self.bytes = 0

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        match = _LAYER.match(name)
        group = f"layer{match.group(1)}" if match else "other"
        if group != self.group:
            self.flush()
            self.group = group
        self.tensors[name] = tensor.detach().contiguous().cpu()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.tensors:
            return
        shard = f"model-{self.shards:05d}.safetensors"
        save_file(self.tensors, str(self.tmp / shard), metadata={"format": "pt"})
        for name, tensor in self.tensors.items():
            self.weight_map[name] = shard
            self.bytes += tensor.numel() * tensor.element_size()
        self.shards += 1
        self.tensors = {}


def write_hf_checkpoint(
    model: torch.nn.Module, shape, out_dir: str | Path, *, send: bool | None = None
) -> StreamReceipt:
    """Stream `model`'s weights (`stream_hf_weights`: collective, call it on every rank) into
    the checkpoint directory `out_dir`, written by the rank that sends (`send`, default as
    there). Returns the stream's receipt; on the writing rank its digest is the directory's
    (`art_protocol.weights_digest.digest_checkpoint`). The writing rank raises
    `FileExistsError` when `out_dir` exists (after the stream: every rank finishes it)."""
    out = Path(out_dir)
    writer = None
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")

    def sink(name: str, tensor: torch.Tensor) -> None:
        nonlocal writer
        if writer is None:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            writer = _ShardWriter(tmp)
        writer(name, tensor)

    try:
        receipt = stream_hf_weights(model, shape, sink, send=send)
        if writer is not None:
            # Checked once every rank is through the collectives: a rank that raised in the
            # middle would leave the others waiting in a gather.
            if out.exists():
                raise FileExistsError(f"{out} exists: every exported version needs its own")
            writer.flush()
            index = {"metadata": {"total_size": writer.bytes}, "weight_map": writer.weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return receipt
