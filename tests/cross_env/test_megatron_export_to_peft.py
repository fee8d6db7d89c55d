"""An adapter trained and exported by the Megatron side is the same adapter for PEFT.

Runs under `.venv-serve`. The training side runs as a subprocess in `.venv-train`
(`python -m art_megatron_ext.lora.train_export`): a Megatron GPT with the tiny model's shape
and weights gets LoRA on q/k/v (fused), o, gate/up (fused), down (a fresh slot, or the tiny
model's PEFT adapter `a` imported), trains 3 Adam steps on CPU,
exports slot `default` as a PEFT directory, and dumps, for fixed inputs, each Megatron site's
LoRA delta split into HF modules, plus its logits for the training tokens. Here `peft` loads
the export onto the HF tiny model and must reproduce those deltas and logits.

Tolerances (float32 on both sides; observed errors in parentheses):
- per-module delta: rtol 1e-4, atol 1e-6 (about 1.5e-7 absolute, 6e-7 relative);
- whole-model logits: atol 1e-4 (about 1.5e-6 on logits of magnitude ~3).

Then the export is published into a running `vllm serve --plugin art` (the shared plain plugin
server) as an in-flight update of slot `policy` while a generation runs: accepted by the
plugin's full validation, and the running generation's spans switch to the new version.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.serve

REPO = Path(__file__).resolve().parents[2]
TRAIN_PYTHON = REPO / ".venv-train" / "bin" / "python"
STEPS = 3


def push_adapter_to_running_server(base_url: str, slot: str, adapter_dir: Path, version: int):
    """Publish `adapter_dir` to `slot` of a running `vllm serve --plugin art` while a streamed
    generation runs there, which the test ends once tokens of the new version arrived
    (tests/support/streamed_ride.py); returns (update result, that generation's choice)."""
    import asyncio

    import httpx
    from support.streamed_ride import ride_a_stream

    body = {
        "model": slot,
        "prompt": "the trainer sends",
        "max_tokens": 460,  # room: the test ends the generation
        "temperature": 0,
        "ignore_eos": True,
    }
    update = {"slot": slot, "path": str(adapter_dir), "version": version}

    async def run():
        async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
            return await ride_a_stream(
                client,
                body,
                update,
                tokens_before=2,
                settled=lambda ride: ride.tokens_of(version) > 0,
            )

    ride = asyncio.run(run())
    assert ride.update.status_code == 200, ride.update.text
    return ride.update.json(), ride.choice


# fresh: a new rank-8 slot (alpha 16); q/k/v and gate/up share one A per fused site.
# from_tiny_a: training starts from the tiny model's PEFT adapter `a` (r 8, alpha 8), whose
# q/k/v and gate/up each have their own A (the stacked slot layout).
START = {"fresh": (8, 16), "from_tiny_a": (8, 8)}


@pytest.fixture(scope="module", params=sorted(START))
def exported(request, server):
    """The training side's export, written inside the server's allowed adapter roots."""
    from support.vllm_server import tiny_paths

    assert TRAIN_PYTHON.exists(), f"{TRAIN_PYTHON} missing: run `make train-env` first"
    model_dir, adapters_dir = tiny_paths()
    out = server.scratch / f"megatron_lora_{request.param}"
    out.mkdir()
    cmd = [
        str(TRAIN_PYTHON),
        "-m",
        "art_megatron_ext.lora.train_export",
        "--hf-model",
        str(model_dir),
        "--out",
        str(out / "adapter"),
        "--deltas",
        str(out / "deltas.safetensors"),
        "--steps",
        str(STEPS),
        "--base-model-name",
        str(model_dir),
    ]
    if request.param == "from_tiny_a":
        cmd += ["--init-adapter", str(adapters_dir / "a")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"training side failed:\n{proc.stderr[-4000:]}"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    return model_dir, out, {**summary, "start": request.param}


@pytest.fixture(scope="module")
def peft_model(exported):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir, out, _ = exported
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, out / "adapter").eval()


@pytest.fixture(scope="module")
def dumps(exported):
    from safetensors.torch import load_file

    return load_file(exported[1] / "deltas.safetensors")


def test_training_side_trained_something(exported, dumps):
    _, _, summary = exported
    assert len(summary["losses"]) == STEPS and summary["losses"][-1] < summary["losses"][0]
    assert summary["delta_modules"] == 7 * 2
    # deltas far from zero, so the comparisons below are not 0 == 0
    assert min(v.abs().max().item() for k, v in dumps.items() if k.endswith(".delta")) > 1e-3


def test_export_loads_into_peft_under_hf_module_names(exported, peft_model):
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    _, out, summary = exported
    config = peft_model.peft_config["default"]
    assert (config.r, config.lora_alpha) == START[summary["start"]]
    assert set(config.target_modules) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    }  # fmt: skip
    written = load_file(out / "adapter" / "adapter_model.safetensors")
    layer0 = "base_model.model.model.layers.0.self_attn"
    q_a, k_a = (written[f"{layer0}.{m}_proj.lora_A.weight"] for m in "qk")
    # fresh: the fused site's one A is written for q, k and v; from_tiny_a: each keeps its own
    assert torch.equal(q_a, k_a) == (summary["start"] == "fresh")
    loaded = get_peft_model_state_dict(peft_model)
    assert written.keys() == loaded.keys()
    assert all(torch.equal(written[k], loaded[k]) for k in written)


def test_peft_deltas_equal_megatron_deltas_per_module(peft_model, dumps):
    modules = dict(peft_model.named_modules())
    names = sorted(k.removesuffix(".input") for k in dumps if k.endswith(".input"))
    assert len(names) == 14
    for name in names:
        layer = modules[f"base_model.model.{name}"]
        x = dumps[f"{name}.input"]
        with torch.no_grad():
            got = layer(x) - layer.base_layer(x)
        torch.testing.assert_close(got, dumps[f"{name}.delta"], rtol=1e-4, atol=1e-6, msg=name)


def test_hf_model_with_export_reproduces_megatron_logits(peft_model, dumps):
    tokens = dumps["__tokens__"]
    with torch.no_grad():
        logits = peft_model(tokens).logits
    torch.testing.assert_close(logits, dumps["__logits__"], rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def server(lora_server):
    """The shared plain plugin server (`lora` in tests/support/server_kinds.py)."""
    return lora_server


def test_export_is_served_as_an_inflight_update(exported, server):
    from art_protocol.client import validate_spans

    _, out, _ = exported
    current = httpx_get_version(server.url)
    _, choice = push_adapter_to_running_server(server.url, "policy", out / "adapter", current + 1)
    spans = validate_spans(choice, len(choice["token_ids"]), latest_version=current + 1)
    assert [s["version"] for s in spans] == [current, current + 1]


def httpx_get_version(url: str) -> int:
    import httpx

    slots = httpx.get(url + "/art/v1/slots", timeout=60).json()
    return {s["slot"]: s["version"] for s in slots}["policy"]
