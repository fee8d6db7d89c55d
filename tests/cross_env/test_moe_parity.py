"""The tiny MoE model is the same model on the Megatron side, in vLLM and in HF transformers.

Runs under `.venv-serve`. The training side runs as a subprocess in `.venv-train`
(`tests/cross_env/moe_megatron_side.py`): the Megatron GPT built from the tiny Qwen3-MoE
checkpoint (`.cache/tiny/moe`, `art_megatron_ext.lora.hf_moe_weights`, fp32, TP = EP = 1)
dumps its logits and, per MoE layer, its router logits and selected experts for fixed
prompts. Here:
- a real `vllm serve --plugin art` of the same checkpoint (the shared `moe_routes` server of
  tests/support/server_kinds.py: `--dtype float32`, eager, no LoRA) returns prompt
  logprobs (top 20 plus the prompt token) that must equal Megatron's log-softmax within
  LOGPROB_ATOL;
- HF transformers' `Qwen3MoeForCausalLM` (fp32) on the same weights gives the router top-k
  that Megatron's router must select on every token whose k-th and (k+1)-th router logits
  are more than TIE_GAP apart. vLLM's own route capture needs Model Runner V2 + Triton,
  which the CPU build lacks (docs/vllm-on-cpu.md "Tiny MoE models on CPU"), so the served
  routes are not compared here.

Tolerances (observed here in parentheses): logprobs vs vLLM atol 1e-4 (about 2e-6);
logits vs HF atol 1e-4 (about 1e-6); router logits vs HF atol 1e-4 (about 1e-6), so a gap
of TIE_GAP = 1e-3 cannot flip between the two sides.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.serve

REPO = Path(__file__).resolve().parents[2]
TRAIN_PYTHON = REPO / ".venv-train" / "bin" / "python"
TINY = REPO / ".cache" / "tiny"
PROMPT_LENGTHS = (16, 24, 40, 64)
TOP_LOGPROBS = 20
LOGPROB_ATOL = 1e-4
TIE_GAP = 1e-3


def moe_model_dir() -> Path:
    """The tiny MoE checkpoint, generating the tiny models if `make tiny` has not run."""
    if not (TINY / "moe" / "config.json").exists():
        from art_vllm_plugin.tiny_model import generate

        generate(TINY)
    return TINY / "moe"


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Fixed token-id prompts: bos, then seeded ids above the special tokens."""
    from art_vllm_plugin.tiny_model import SPECIAL_TOKENS

    vocab = json.loads((moe_model_dir() / "config.json").read_text())["vocab_size"]
    rng = random.Random(15)
    return [
        [1] + [rng.randrange(len(SPECIAL_TOKENS), vocab) for _ in range(n - 1)]
        for n in PROMPT_LENGTHS
    ]


@pytest.fixture(scope="module")
def megatron(prompts, tmp_path_factory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    assert TRAIN_PYTHON.exists(), f"{TRAIN_PYTHON} missing: run `make train-env` first"
    tmp = tmp_path_factory.mktemp("moe_parity")
    (tmp / "prompts.json").write_text(json.dumps(prompts))
    cmd = [
        str(TRAIN_PYTHON),
        str(REPO / "tests" / "cross_env" / "moe_megatron_side.py"),
        "--hf-model",
        str(moe_model_dir()),
        "--prompts",
        str(tmp / "prompts.json"),
        "--out",
        str(tmp / "dump.safetensors"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"training side failed:\n{proc.stderr[-4000:]}"
    return load_file(tmp / "dump.safetensors")


@pytest.fixture(scope="module")
def hf(prompts):
    """Per prompt: (fp32 logits [seq, vocab], router logits per MoE layer [seq, experts])."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_model_dir(), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            res = model(torch.tensor([ids]), output_router_logits=True)
            out.append((res.logits[0], [r.float() for r in res.router_logits]))
    return out


@pytest.fixture(scope="module")
def served(prompts, moe_routes_server) -> list[list[dict[int, float] | None]]:
    """Per prompt, vLLM's prompt logprobs: per position None or {token id: logprob}."""
    import httpx

    srv = moe_routes_server
    model = srv.config.model
    assert model == str(moe_model_dir())
    out = []
    for ids in prompts:
        resp = httpx.post(
            srv.url + "/v1/completions",
            json={
                "model": model,
                "prompt": ids,
                "max_tokens": 1,
                "temperature": 0,
                "prompt_logprobs": TOP_LOGPROBS,
            },
            timeout=120,
        )
        assert resp.status_code == 200, resp.text
        rows = resp.json()["choices"][0]["prompt_logprobs"]
        out.append(
            [
                None if row is None else {int(k): v["logprob"] for k, v in row.items()}
                for row in rows
            ]
        )
    return out


def test_served_model_is_the_tiny_moe():
    cfg = json.loads((moe_model_dir() / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert cfg["mlp_only_layers"] == [0] and cfg["num_hidden_layers"] == 3


def test_megatron_logits_equal_hf_logits(prompts, megatron, hf):
    for p in range(len(prompts)):
        torch.testing.assert_close(megatron[f"p{p}.logits"], hf[p][0], rtol=0, atol=1e-4)


def test_megatron_logprobs_equal_vllm_prompt_logprobs(prompts, megatron, served):
    compared = 0
    worst = 0.0
    for p, ids in enumerate(prompts):
        logprobs = torch.log_softmax(megatron[f"p{p}.logits"].double(), dim=-1)
        rows = served[p]
        assert len(rows) == len(ids) and rows[0] is None
        for t in range(1, len(ids)):
            row = rows[t]
            assert ids[t] in row and len(row) >= TOP_LOGPROBS, (p, t)
            for token, value in row.items():
                err = abs(logprobs[t - 1, token].item() - value)
                worst = max(worst, err)
                assert err <= LOGPROB_ATOL, (p, t, token, value, logprobs[t - 1, token].item())
                compared += 1
    print(f"compared {compared} logprobs, max abs error {worst:.2e}")
    assert compared >= sum(n - 1 for n in PROMPT_LENGTHS) * TOP_LOGPROBS


def test_megatron_router_topk_equals_hf_router_topk_off_near_ties(prompts, megatron, hf):
    from art_vllm_plugin.tiny_model import TinyModelConfig

    k = TinyModelConfig().moe_top_k
    moe_layers = sorted(
        {int(name.split(".L")[1].split(".")[0]) for name in megatron if ".L" in name}
    )
    assert moe_layers == [1, 2]
    total = agree = ties = agree_off_ties = 0
    for p in range(len(prompts)):
        for i, layer in enumerate(moe_layers):
            hf_logits = hf[p][1][i]
            torch.testing.assert_close(
                megatron[f"p{p}.L{layer}.router_logits"], hf_logits, rtol=0, atol=1e-4
            )
            top = torch.topk(hf_logits, k + 1, dim=-1).values
            near_tie = (top[:, k - 1] - top[:, k]) < TIE_GAP
            hf_sel = torch.zeros_like(hf_logits, dtype=torch.bool)
            hf_sel.scatter_(1, torch.topk(hf_logits, k, dim=-1).indices, True)
            mg_sel = megatron[f"p{p}.L{layer}.experts"]
            assert (mg_sel.sum(-1) == k).all()
            same = (mg_sel == hf_sel).all(-1)
            total += len(same)
            agree += int(same.sum())
            ties += int(near_tie.sum())
            agree_off_ties += int(same[~near_tie].sum())
            mismatch = (~same & ~near_tie).nonzero().flatten().tolist()
            assert not mismatch, f"prompt {p} layer {layer}: routes differ at tokens {mismatch}"
    print(
        f"router top-{k} agreement: {agree}/{total} token-layers ({agree / total:.2%}), "
        f"{ties} near ties (gap < {TIE_GAP}), {agree_off_ties}/{total - ties} off ties"
    )
    assert total == sum(PROMPT_LENGTHS) * len(moe_layers)
    assert ties <= total // 20  # the comparison covers (almost) every token
