"""`route_spans` across an in-flight LoRA update, on a real `vllm serve` of the tiny Qwen3-MoE.

The server runs `--art-routes --enable-lora --lora-target-modules q_proj k_proj v_proj o_proj`:
in the CPU build LoRA on a MoE model is served only with the experts left out of the targets
(`art_vllm_plugin.worker.moe_lora_cpu`), so the adapters here are attention-only PEFT adapters
made from the MoE model itself (seeded, real safetensors).

The update lands mid-generation deterministically, as in
`tests/art_vllm_plugin/test_inflight_update.py`: the engine freezes the routed request itself
after a few of its steps (tests/support/step_hold.py), the test publishes version 2 and
resumes. Row t of the routes was produced by the forward that sampled token t+1, so the route
span boundary sits one row before the policy span boundary (in sequence positions).
"""

from __future__ import annotations

import asyncio
import itertools
import json

import httpx
import numpy as np
import pytest
from support.step_hold import update_after_steps

from art_protocol.client import ArtClient, decode_routed_completion, validate_spans
from art_vllm_plugin import serve_process

pytestmark = pytest.mark.serve

PROMPT_LEN = 24
LONG = 160
STEPS_BEFORE_UPDATE = 8
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def moe_model():
    from support.vllm_server import TINY, tiny_paths

    tiny_paths()
    path = TINY / "moe"
    if not (path / "config.json").exists():
        pytest.fail("the tiny MoE model is missing: run `make tiny`")
    return path


def _write_attention_adapter(model_dir, seed: int, out) -> None:
    """A PEFT LoRA on the attention projections only (random A and B from `seed`)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=list(ATTENTION),
        lora_dropout=0.0,
        bias="none",
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    get_peft_model(base, config).save_pretrained(out, safe_serialization=True)
    cfg_path = out / "adapter_config.json"
    data = json.loads(cfg_path.read_text())
    data["base_model_name_or_path"] = "art-tiny-moe"
    data["target_modules"] = sorted(data["target_modules"])
    cfg_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


@pytest.fixture(scope="module")
def adapters(moe_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-adapters")
    for name, seed in (("a", 11), ("b", 22)):
        _write_attention_adapter(moe_model, seed, root / name)
    return root


@pytest.fixture(scope="module")
def server(moe_model, adapters, server_log):
    """A server of its own: the only MoE server with LoRA (attention-only targets, made from
    the MoE model by this module); no other module needs that configuration."""
    config = serve_process.ServeConfig(
        model=str(moe_model),
        args=(
            *("--dtype", "float32", "--enforce-eager", "--max-model-len", "512"),
            *("--gpu-memory-utilization", "0.2", "--art-routes"),
            *("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"),
            *("--lora-target-modules", *ATTENTION),
            *("--lora-modules", f"policy={adapters / 'a'}"),
            *("--art-adapter-root", str(adapters)),
            *serve_process.ALLOW_UNAUTHENTICATED,  # updates without a key
        ),
        # vLLM's /is_paused and /resume routes and the step hold (tests/support/step_hold.py);
        # /v1/load_lora_adapter for the refusal test.
        env={
            "VLLM_SERVER_DEV_MODE": "1",
            "ART_TEST_HOOKS": "1",
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        },
        log_path=server_log,
    )
    with serve_process.serving(config) as srv:
        yield srv


def _prompt() -> list[int]:
    return np.random.default_rng(5).integers(3, 500, PROMPT_LEN).tolist()


def _body() -> dict:
    return {
        "model": "policy",
        "prompt": _prompt(),
        "max_tokens": LONG,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "return_routes": True,
    }


def _version(server) -> int:
    with ArtClient(server.url, timeout=60) as art:
        return {s["slot"]: s["version"] for s in art.slots()}["policy"]


def _routed(resp: httpx.Response):
    assert resp.status_code == 200, resp.text
    return decode_routed_completion(resp.content)


async def _update_mid_generation(server, path, version):
    """A routed generation; `version` is published after STEPS_BEFORE_UPDATE of its engine
    steps (the engine holds itself there: tests/support/step_hold.py)."""
    update = {"slot": "policy", "path": str(path), "version": version}
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        return await update_after_steps(
            client,
            lambda: client.post("/art/v1/completions", json=_body()),
            STEPS_BEFORE_UPDATE,
            update,
        )


def _row_versions(policy_spans, prompt_len: int, rows: int) -> list[int]:
    """Row t's version, from first principles: the version that sampled token t+1."""
    token_version = [s["version"] for s in policy_spans for _ in range(s["start"], s["end"])]
    return [token_version[max(t + 1 - prompt_len, 0)] for t in range(rows)]


def test_route_spans_follow_the_next_tokens_version_across_an_update(server, adapters):
    v1 = _version(server)
    baseline = _routed(httpx.post(server.url + "/art/v1/completions", json=_body(), timeout=300))
    base_tokens = baseline.completion["choices"][0]["token_ids"]
    base_rows = baseline.routes[0]

    resp, upd, s0 = asyncio.run(_update_mid_generation(server, adapters / "b", v1 + 1))
    routed = _routed(resp)
    choice = routed.completion["choices"][0]
    tokens, rows = choice["token_ids"], routed.routes[0]
    v2 = upd["version"]
    assert v2 == v1 + 1 == _version(server)

    # Policy spans: v1 then v2, the switch mid-generation at the update step.
    spans = validate_spans(choice, LONG, latest_version=v2)
    assert [(s["slot"], s["version"]) for s in spans] == [("policy", v1), ("policy", v2)]
    k = spans[0]["end"]
    assert STEPS_BEFORE_UPDATE <= k < LONG and k == upd["step"] - s0

    # Route spans: same shape rules as policy spans, over the returned rows.
    n_rows = PROMPT_LEN + LONG - 1
    assert rows.shape[0] == n_rows == choice["routes"]["rows"]
    assert choice["routes"]["prompt_start"] == 0
    route_spans = choice["route_spans"]
    assert all(set(s) == {"start", "end", "slot", "version"} for s in route_spans)
    assert route_spans[0]["start"] == 0 and route_spans[-1]["end"] == n_rows
    assert all(a["end"] == b["start"] for a, b in itertools.pairwise(route_spans))
    assert all(s["start"] < s["end"] for s in route_spans)
    # ... and row t carries the version that sampled token t+1: the boundary is shifted by one.
    boundary = PROMPT_LEN - 1 + k
    assert route_spans == [
        {"start": 0, "end": boundary, "slot": "policy", "version": v1},
        {"start": boundary, "end": n_rows, "slot": "policy", "version": v2},
    ]
    per_row = [s["version"] for s in route_spans for _ in range(s["start"], s["end"])]
    assert per_row == _row_versions(spans, PROMPT_LEN, n_rows)

    # The rows are what the engine selected: before the update the request ran exactly like the
    # un-updated baseline, so its tokens and every v1 row are the baseline's; the v2 rows were
    # routed under the new attention weights.
    assert tokens[:k] == base_tokens[:k]
    np.testing.assert_array_equal(rows[:boundary], base_rows[:boundary])
    assert not np.array_equal(rows[boundary:], base_rows[boundary:])
    assert rows.min() >= 0 and rows.max() < 8


def test_adapter_with_expert_weights_is_refused_and_slot_keeps_serving(server, adapters):
    """The experts are outside the LoRA targets: an adapter carrying expert deltas is refused
    at load by stock vLLM loading too (never applied without them), and the slot keeps its
    version."""
    import torch
    from safetensors.torch import load_file, save_file

    bad = adapters / "experts"
    bad.mkdir()
    src = adapters / "b"
    tensors = load_file(src / "adapter_model.safetensors")
    moe_layer = next(k for k in tensors if ".layers.1.self_attn.q_proj.lora_A" in k)
    prefix = moe_layer.split("self_attn")[0]  # layer 1 is a MoE layer (layer 0 is dense)
    torch.manual_seed(3)
    tensors[prefix + "mlp.experts.0.gate_proj.lora_A.weight"] = torch.randn(8, 128)
    tensors[prefix + "mlp.experts.0.gate_proj.lora_B.weight"] = torch.randn(64, 8)
    save_file(tensors, bad / "adapter_model.safetensors", metadata={"format": "pt"})
    (bad / "adapter_config.json").write_text((src / "adapter_config.json").read_text())

    before = _version(server)
    stock = httpx.post(
        server.url + "/v1/load_lora_adapter",
        json={"lora_name": "with_experts", "lora_path": str(bad)},
        timeout=120,
    )
    assert stock.status_code >= 400, stock.text
    assert "weights for MoE experts" in stock.text
    assert "layers.1.mlp.experts.0.gate_proj" in stock.text
    update = httpx.post(
        server.url + "/art/v1/lora/update",
        json={"slot": "policy", "path": str(bad), "version": before + 1},
        timeout=120,
    )
    assert update.status_code == 422, update.text
    assert "mlp.experts.0.gate_proj" in update.text
    assert _version(server) == before
