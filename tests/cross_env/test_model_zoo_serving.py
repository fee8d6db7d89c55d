"""Zoo models trained and exported by the Megatron side are served by vLLM as HF runs them.

Runs under `.venv-serve`. For the dense zoo models with what real checkpoints carry
(`support.model_zoo`): Qwen2.5 (q/k/v biases, tied embeddings), Qwen3 (q/k norms, head_dim
!= hidden / heads) and Llama-3.2 (rope llama3, tied), each with a vocabulary of 1030 (a
multiple of neither 4 nor 128):
- the training side (`tests/cross_env/zoo_train_side.py` in `.venv-train`, fp32, TP = 1) loads
  each checkpoint into a Megatron GPT with the vocabulary padded to 1152
  (`make_vocab_size_divisible_by=128`), takes one Adam step on the real columns'
  cross-entropy and writes it with `write_hf_checkpoint` (`full`); separately it attaches LoRA
  (rank 8, q/k/v, o, gate/up, down) to the unstepped model, draws B at random and exports it
  for PEFT (`adapter`);
- here a real `vllm serve full --plugin art --enable-lora --dtype float32
  --lora-modules zoo=adapter` per model (the three started side by side, on the model runner
  the suite runs: Model Runner V2 by default, `tests/support/model_runner.py`) must give, for
  fixed token-id prompts, the greedy tokens HF transformers gives in fp32 on the same files,
  and, with the adapter, those of HF + `peft.PeftModel`, each token's log-probability within
  LOGPROB_ATOL of HF's; the step and the adapter must each change the tokens (not vacuous);
- the export holds exactly the checkpoint's tensor names (no `lm_head.weight` when tied) with
  1030 vocabulary rows (vLLM's loader also refuses any other row count), and the server's
  vocabulary is 1030: token 1029 is accepted, 1030 is out of vocabulary (vLLM bounds prompt
  ids by max(tokenizer, model vocabulary); the tiny tokenizer has fewer ids).

The zoo has no tokenizer: the tiny model's (fewer than 1030 ids) is copied beside each export.
Greedy tokens are compared up to the first near tie (HF's best two logits closer than TIE_GAP,
where sums in another order may pick the other). Observed here (2026-12-07, 2 cores, MRV2):
no near tie, all 48 tokens per model equal with and without the adapter, log-probabilities
within 3e-6; the module takes about 110 s on a quiet machine (three server starts side by side:
about 80 s; peak about 9 GB RSS for the three servers).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from support.zoo_serving import (
    N_TOKENS,
    PROMPTS,
    VOCAB,
    assert_same_greedy,
    export_zoo,
    load_export,
    served_greedy,
    stop_started,
)

pytestmark = pytest.mark.serve

PADDED_VOCAB = 1152  # 1030 rounded up to a multiple of 128
LORA = "zoo"
TIED = {"qwen2.5": True, "qwen3": False, "llama3.2": True}  # the models, and which are tied
MODELS = sorted(TIED)
LORA_MODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, dict]:
    """Per model: the zoo checkpoint, its export (`full`, `adapter`) and the training side's
    summary."""
    return export_zoo(tmp_path_factory.mktemp("zoo_serving"), MODELS, adapters=True)


def _config(model: dict):
    from art_vllm_plugin import serve_process

    return serve_process.ServeConfig(
        model=str(model["full"]),
        args=(
            *serve_process.tiny_lora_args(max_loras=1),
            *("--dtype", "float32"),  # after tiny_lora_args' bfloat16: the last one counts
            *("--lora-modules", f"{LORA}={model['adapter']}"),
        ),
        log_path=model["log"],
        startup_timeout_s=600.0,
    )


def _hf_references(model: dict) -> dict[str, list]:
    """Greedy continuations of every prompt by the original zoo checkpoint, the export, and
    the export with the adapter (HF transformers and peft, fp32). One torch thread: the
    servers start on the same two cores meanwhile."""
    from peft import PeftModel
    from support.zoo_serving import hf_greedy
    from transformers import AutoModelForCausalLM

    def load(path):
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            original = load(model["zoo"])
            out = {"original": [hf_greedy(original, p, N_TOKENS) for p in PROMPTS]}
            base = load(model["full"])
            out["base"] = [hf_greedy(base, p, N_TOKENS) for p in PROMPTS]
            lora = PeftModel.from_pretrained(base, str(model["adapter"])).eval()
            out["lora"] = [hf_greedy(lora, p, N_TOKENS) for p in PROMPTS]
    finally:
        torch.set_num_threads(threads)
    return out


def _served_both(url: str, model: dict) -> dict[str, list]:
    return {"base": served_greedy(url, str(model["full"])), "lora": served_greedy(url, LORA)}


@pytest.fixture(scope="module")
def served(exported):
    """Per model: its server (started side by side), HF references (computed while the servers
    start) and vLLM's greedy tokens without and with the adapter."""
    from art_vllm_plugin import serve_process

    t0 = time.monotonic()
    pool = ThreadPoolExecutor(len(exported))
    starts = {name: pool.submit(serve_process.start, _config(m)) for name, m in exported.items()}
    servers = {}
    try:
        refs = {name: _hf_references(m) for name, m in exported.items()}
        t_hf = time.monotonic() - t0
        for name, future in starts.items():
            servers[name] = future.result()
        t_up = time.monotonic() - t0
        tokens = {
            name: pool.submit(_served_both, servers[name].url, exported[name]) for name in exported
        }
        out = {
            name: {"server": servers[name], "hf": refs[name], "vllm": tokens[name].result()}
            for name in exported
        }
        print(
            f"HF references {t_hf:.1f}s, servers up {t_up:.1f}s, "
            f"completions {time.monotonic() - t0 - t_up:.1f}s"
        )
        yield out
    finally:
        stop_started(starts, pool)


@pytest.mark.parametrize("name", MODELS)
def test_export_has_the_checkpoints_names_and_no_padded_rows(exported, name):
    from safetensors.torch import load_file

    model = exported[name]
    summary = model["summary"]
    assert summary["padded_vocab"] == PADDED_VOCAB  # the padding was there to trim
    assert summary["padded_rows_zero"]  # and the step left it at 0
    want = load_file(model["zoo"] / "model.safetensors")
    got = load_export(model["full"])
    assert sorted(got) == sorted(want)  # biases and norms there, lm_head only when untied
    assert ("lm_head.weight" in got) == (not TIED[name])
    assert {k: t.shape for k, t in got.items()} == {k: t.shape for k, t in want.items()}
    assert got["model.embed_tokens.weight"].shape[0] == VOCAB
    assert {t.dtype for t in got.values()} == {torch.float32}
    assert any(not torch.equal(got[k], want[k].float()) for k in want)  # the step is in it
    assert summary["receipt"]["tensors"] == len(want)


@pytest.mark.parametrize("name", MODELS)
def test_adapter_covers_every_target(exported, name):
    config = json.loads((exported[name]["adapter"] / "adapter_config.json").read_text())
    assert (config["r"], set(config["target_modules"])) == (8, LORA_MODULES)
    assert exported[name]["summary"]["lora_sites"] == 4 * 2  # 4 Megatron sites per layer


@pytest.mark.parametrize("name", MODELS)
def test_served_vocabulary_is_the_checkpoints(served, exported, name):
    assert json.loads((exported[name]["full"] / "config.json").read_text())["vocab_size"] == VOCAB
    url = served[name]["server"].url
    model = str(exported[name]["full"])
    for last, status in ((VOCAB - 1, 200), (VOCAB, 400)):
        resp = httpx.post(
            url + "/v1/completions",
            json={"model": model, "prompt": [1, last], "max_tokens": 1, "temperature": 0},
            timeout=120,
        )
        assert resp.status_code == status, resp.text
    assert f"Token id {VOCAB} is out of vocabulary" in resp.text


@pytest.mark.parametrize("name", MODELS)
def test_served_greedy_tokens_equal_hf(served, name):
    assert_same_greedy(served[name]["vllm"]["base"], served[name]["hf"]["base"], name)


@pytest.mark.parametrize("name", MODELS)
def test_served_lora_greedy_tokens_equal_hf_peft(served, name):
    assert_same_greedy(served[name]["vllm"]["lora"], served[name]["hf"]["lora"], f"{name}+lora")


@pytest.mark.parametrize("name", MODELS)
def test_the_step_and_the_adapter_change_the_tokens(served, name):
    """Not vacuous: the served export is not the original checkpoint, and the adapter is not
    a no-op."""
    vllm, hf = served[name]["vllm"], served[name]["hf"]
    base = [tokens for tokens, _ in vllm["base"]]
    assert base != [ref.tokens for ref in hf["original"]]
    assert [tokens for tokens, _ in vllm["lora"]] != base
