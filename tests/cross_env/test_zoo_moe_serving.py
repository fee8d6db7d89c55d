"""The zoo's MoE and multi-latent-attention models, trained and exported by the Megatron side,
are served by vLLM as HF runs them.

Runs under `.venv-serve`. For Qwen3-MoE (q/k norms, 8 experts top-2, a dense first layer) and
DeepSeek-V3 (`deepseek-v3`: multi-latent attention with DeepSeek-V3's latent and rope widths
and its yarn rope, a dense first layer, then an MoE layer with sigmoid grouped routing, the
score-correction bias, a routed scaling factor and a shared expert):
- the training side (`zoo_train_side.py --full-only`, `.venv-train`, fp32, TP = 1) loads each
  checkpoint into its Megatron model (`lora.hf_moe_weights`, `lora.hf_deepseek`; DeepSeek's
  vocabulary padded to 1152), takes one Adam step and writes it with `write_hf_checkpoint`;
- here a real `vllm serve full --plugin art --dtype float32` per model (both started side by
  side, on the suite's model runner) must give, for fixed token-id prompts, the greedy tokens HF
  transformers gives in fp32 on the same files, each log-probability within LOGPROB_ATOL; the
  export holds exactly the checkpoint's tensor names and shapes, and the step changed tokens.
No adapter: the CPU build of vLLM serves no LoRA on MoE experts, and the MLA LoRA sites are not
mapped. DeepSeek-V3's attention runs on vLLM's reference CPU MLA backend (`CPU_MLA`): on this
CPU vLLM picks its AMX backend, which serves bf16 only and fails the fp32 model at load.

DeepSeek-V3 is served with `--enforce-eager`: vLLM 0.32's CPU build compiles the model with
torch.compile by default, and compiled, DeepSeek-V3's MoE layer served log-probabilities
0.2-0.6 off HF's, different from one start to the next (one start answered non-finite
log-probabilities; on Model Runner V2 the compiled server failed at start, all-NaN logits in
its warm-up); eager, the same server (with and without the plugin) and vLLM in-process
equal HF within 2.3e-6, and the MoE layer's output equals HF's to 8e-7 at every step
(measured 2026-12-08, docs/model-mapping.md). Qwen3-MoE's compiled MoE layers are exact.

Observed here: both models equal HF on every compared token (48 each), log-probabilities
within 2.1e-6; 6 passed in 147 s on a quiet host (two server starts side by side).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from support.zoo_serving import (
    N_TOKENS,
    PROMPTS,
    assert_same_greedy,
    export_zoo,
    load_export,
    served_greedy,
    stop_started,
)

pytestmark = pytest.mark.serve

MODELS = ("deepseek-v3", "qwen3-moe")
EXTRA_ARGS = {"deepseek-v3": ("--attention-backend", "CPU_MLA", "--enforce-eager"), "qwen3-moe": ()}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, dict]:
    """Per model: the zoo checkpoint, its stepped export and the training side's summary."""
    return export_zoo(tmp_path_factory.mktemp("zoo_moe_serving"), MODELS, adapters=False)


def _config(name: str, model: dict):
    from art_vllm_plugin import serve_process

    return serve_process.ServeConfig(
        model=str(model["full"]),
        args=(
            *("--dtype", "float32", "--max-model-len", "512"),
            *("--gpu-memory-utilization", "0.2"),  # of host memory: leave room for the other
            *EXTRA_ARGS[name],
            *serve_process.ALLOW_UNAUTHENTICATED,
        ),
        log_path=model["log"],
        startup_timeout_s=600.0,
    )


def _hf_references(model: dict) -> dict[str, list]:
    """Greedy continuations by the original checkpoint and by the export (HF, fp32, one torch
    thread while the servers start on the same cores)."""
    from support.zoo_serving import hf_greedy
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        with torch.no_grad():
            for key in ("zoo", "full"):
                hf = AutoModelForCausalLM.from_pretrained(str(model[key]), dtype=torch.float32)
                out[key] = [hf_greedy(hf.eval(), p, N_TOKENS) for p in PROMPTS]
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def served(exported):
    """Per model: HF references (computed while the servers start side by side) and vLLM's
    greedy tokens on the export."""
    from art_vllm_plugin import serve_process

    t0 = time.monotonic()
    pool = ThreadPoolExecutor(len(exported))
    starts = {n: pool.submit(serve_process.start, _config(n, m)) for n, m in exported.items()}
    try:
        refs = {name: _hf_references(m) for name, m in exported.items()}
        servers = {name: future.result() for name, future in starts.items()}
        tokens = {n: served_greedy(servers[n].url, str(exported[n]["full"])) for n in exported}
        print(f"references, starts and completions in {time.monotonic() - t0:.1f}s")
        yield {name: {"hf": refs[name], "vllm": tokens[name]} for name in exported}
    finally:
        stop_started(starts, pool)


@pytest.mark.parametrize("name", MODELS)
def test_export_has_the_checkpoints_names_and_shapes(exported, name):
    from safetensors.torch import load_file

    model = exported[name]
    want = load_file(model["zoo"] / "model.safetensors")
    got = load_export(model["full"])
    assert {k: t.shape for k, t in got.items()} == {k: t.shape for k, t in want.items()}
    assert any(not torch.equal(got[k].float(), want[k].float()) for k in want)  # the step
    assert model["summary"]["padded_rows_zero"]
    assert model["summary"]["receipt"]["tensors"] == len(want)


@pytest.mark.parametrize("name", MODELS)
def test_served_greedy_tokens_equal_hf(served, name):
    assert_same_greedy(served[name]["vllm"], served[name]["hf"]["full"], name)


@pytest.mark.parametrize("name", MODELS)
def test_the_step_changes_the_tokens(served, name):
    tokens = [t for t, _ in served[name]["vllm"]]
    assert tokens != [ref.tokens for ref in served[name]["hf"]["zoo"]]
