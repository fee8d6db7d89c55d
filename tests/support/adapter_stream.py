"""A trainer's LoRA adapter in memory and its stream (`StreamSender.send_adapter`), for the
streamed LoRA update tests (test_streamed_lora_update*.py)."""

from __future__ import annotations

import asyncio
import json

import httpx
from safetensors.torch import load_file
from safetensors.torch import save as save_safetensors

from art_protocol.adapter_stream import config_bytes
from art_protocol.digest import digest_bytes
from support.greedy import PROMPT
from support.step_hold import update_after_steps

#: Tokens of the generation an update lands in, and engine steps before it lands.
LONG = 48
STEPS_BEFORE_UPDATE = 8


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


def stream_mid_generation(url: str, publish, headers: dict | None = None) -> tuple[dict, dict, int]:
    """A greedy completion of LONG tokens on slot `policy` with `publish()` (a blocking
    streamed update) landing after STEPS_BEFORE_UPDATE of its steps (the engine holds itself
    there: support/step_hold): (the completion's choice, the update's answer, its step within
    the generation)."""
    body = {
        "model": "policy",
        "prompt": PROMPT,
        "max_tokens": LONG,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            return await update_after_steps(
                http,
                lambda: http.post("/v1/completions", json=body, headers=headers),
                STEPS_BEFORE_UPDATE,
                publish,
            )

    resp, upd, s0 = asyncio.run(run())
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0], upd, upd["step"] - s0
