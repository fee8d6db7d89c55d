"""Helpers of the full-weight update tests on the shared dp2 server
(tests/art_vllm_plugin/test_full_weight_update.py, test_streamed_weight_update.py): a
trainer's export of the tiny model with noise, Hugging Face greedy references in float32,
completions pinned to an engine, each engine's base version."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file, save_file

from support.step_hold import update_after_steps

PROMPT = "the policy model learns from the reward and the trainer sends its weights"
ROUTE = "/art/v1/weights/update"
SHORT = 12
LONG = 48
STEPS_BEFORE_UPDATE = 8


class Server:
    """The shared server, where a module's exports go (`root`, inside its adapter root), the
    served model's directory, and the next base version to publish (after the current one:
    an earlier module may have published some)."""

    def __init__(self, shared, root: Path, model: Path):
        self.shared, self.root, self.model = shared, root, model
        current = httpx.get(shared.url + "/art/v1/weights", timeout=60).json()["version"]
        self.next_version = current + 1

    @property
    def url(self) -> str:
        return self.shared.url

    def version(self) -> int:
        v = self.next_version
        self.next_version += 1
        return v


def export(server: Server, name: str, edit=None, noise: float = 0.0, seed: int = 0) -> Path:
    """A trainer's export: the served checkpoint's tensors (with `noise` added, then `edit`
    applied to the dict), in a model directory under the server's adapter root."""
    out = server.root / "trainer" / name
    shutil.copytree(server.model, out)
    tensors = load_file(str(server.model / "model.safetensors"))
    if noise:
        g = torch.Generator().manual_seed(seed)
        tensors = {
            k: (v.float() + noise * torch.randn(v.shape, generator=g)).to(v.dtype)
            for k, v in tensors.items()
        }
    if edit is not None:
        edit(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def hf_greedy(model_dir: Path, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy tokens of Hugging Face transformers in float32 on `model_dir`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    ids = torch.tensor([prompt_ids])
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def hf_greedy_across_update(
    old_dir: Path, new_dir: Path, prompt_ids: list[int], before: list[int], n: int
) -> list[int]:
    """The `n` greedy tokens a generation continues with once the weights switched from
    `old_dir` to `new_dir` after its tokens `before` (Hugging Face, float32): as in a server,
    the keys and values of the prompt and of `before` but its last token were computed by the
    old weights, and every forward from then on (the one reading that last token first) by
    the new ones."""
    from transformers import AutoModelForCausalLM

    old = AutoModelForCausalLM.from_pretrained(str(old_dir), torch_dtype=torch.float32)
    new = AutoModelForCausalLM.from_pretrained(str(new_dir), torch_dtype=torch.float32)
    out = []
    with torch.no_grad():
        cache = old(torch.tensor([prompt_ids + before[:-1]]), use_cache=True).past_key_values
        nxt = before[-1]
        for _ in range(n):
            step = new(torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            nxt = int(step.logits[0, -1].argmax())
            out.append(nxt)
    return out


def complete(server, engine: int, model: str | None = None, max_tokens: int = SHORT, **kw) -> dict:
    body = {
        "model": model or str(server.model),
        "prompt": kw.pop("prompt", PROMPT),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **kw,
    }
    resp = httpx.post(
        server.url + "/v1/completions",
        json=body,
        headers={"X-data-parallel-rank": str(engine)},
        timeout=300,
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def tokens(server, engine: int, **kw) -> list[int]:
    return complete(server, engine, **kw)["choices"][0]["token_ids"]


def prompt_ids(server) -> list[int]:
    return complete(server, 0, max_tokens=1)["choices"][0]["prompt_token_ids"]


def update(server, path: Path, version: int, **kw) -> httpx.Response:
    body = {"path": str(path), "version": version, **kw}
    return httpx.post(server.url + ROUTE, json=body, timeout=600)


def engine(server, rank: int) -> dict:
    resp = httpx.get(f"{server.url}/art/v1/engine", params={"engine": rank}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def base_versions(server) -> list[int]:
    return [engine(server, rank)["base_version"] for rank in (0, 1)]


def generate_across_update(server, update) -> tuple[httpx.Response, dict, int]:
    """A greedy completion of LONG tokens on engine 0 with `update` (a body for ROUTE, or a
    blocking callable that publishes: a stream) landing after STEPS_BEFORE_UPDATE of its
    steps: (the completion's response, the update's answer, the step count before it)."""
    body = {
        "model": str(server.model),
        "prompt": PROMPT,
        "max_tokens": LONG,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }

    async def run():
        pin = {"X-data-parallel-rank": "0"}
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            return await update_after_steps(
                client,
                lambda: client.post("/v1/completions", json=body, headers=pin),
                STEPS_BEFORE_UPDATE,
                update,
                route=ROUTE,
            )

    return asyncio.run(run())
