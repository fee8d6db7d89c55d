"""A trainer's LoRA adapter in memory and its stream (`StreamSender.send_adapter`), for the
streamed LoRA update tests (test_streamed_lora_update*.py)."""

from __future__ import annotations

import json

from safetensors.torch import load_file
from safetensors.torch import save as save_safetensors

from art_protocol.adapter_stream import config_bytes
from art_protocol.digest import digest_bytes


class Adapter:
    """A trainer's adapter in memory: its config and its tensors (PEFT names)."""

    def __init__(self, path):
        self.config = json.loads((path / "adapter_config.json").read_text())
        self.tensors = load_file(str(path / "adapter_model.safetensors"))

    def plan(self) -> list[tuple]:
        return [(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]

    def digest(self) -> str:
        """The digest of the two files the server writes from this adapter."""
        weights = save_safetensors(self.tensors, metadata={"format": "pt"})
        return digest_bytes(config_bytes(self.config), weights)


def stream(sender, slot: str, version: int, adapter: Adapter, plan=None, **kw) -> dict:
    """Publish `adapter` as `version` of `slot`, its tensors in reverse name order."""

    def produce(sink):
        for name in sorted(adapter.tensors, reverse=True):
            sink(name, adapter.tensors[name])

    return sender.send_adapter(slot, version, adapter.config, plan or adapter.plan(), produce, **kw)
