"""What the zoo's serving tests share: the prompts, HF greedy references, vLLM's greedy
tokens, and their comparison up to the first near tie. Serving side only (vLLM, transformers
and peft in `.venv-serve`). Not collected by pytest.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parents[2]
TRAIN_PYTHON = REPO / ".venv-train" / "bin" / "python"
TRAIN_SIDE = REPO / "tests" / "cross_env" / "zoo_train_side.py"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
VOCAB = 1030  # support.model_zoo.ZOO_VOCAB
N_TOKENS = 16
TIE_GAP = 1e-4
LOGPROB_ATOL = 1e-4


def _prompts() -> list[list[int]]:
    """bos, then seeded ids above the special tokens; the last row (1029) in the first."""
    g = torch.Generator().manual_seed(34)
    prompts = [[1, *torch.randint(6, VOCAB, (n,), generator=g).tolist()] for n in (7, 19, 40)]
    prompts[0][3] = VOCAB - 1
    return prompts


PROMPTS = _prompts()


@dataclass(frozen=True)
class Greedy:
    """Greedy tokens, each one's log-probability, and the gap between the best and
    second-best logit at each step."""

    tokens: list[int]
    logprobs: list[float]
    gaps: list[float]


def hf_greedy(model, prompt: list[int], n: int) -> Greedy:
    """`model.generate` greedy continuation of `prompt` (fp32, `n` tokens, no stop at EOS, as
    vLLM's `ignore_eos`), with log-probabilities from the raw logits (vLLM's default
    `raw_logprobs`)."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=0,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    assert len(tokens) == n, f"HF generated {len(tokens)} tokens, not {n}"
    logprobs, gaps = [], []
    for token, logits in zip(tokens, out.logits, strict=True):
        row = logits[0].double()
        logprobs.append(float(torch.log_softmax(row, dim=-1)[token]))
        top = torch.topk(row, 2).values
        gaps.append(float(top[0] - top[1]))
    return Greedy(tokens, logprobs, gaps)


def compared_prefix(gaps: list[float], tie_gap: float) -> int:
    """How many leading greedy tokens must agree: up to the first near tie (best and second
    logit closer than `tie_gap`, where fp32 sums in another order may pick the other)."""
    return next((i for i, gap in enumerate(gaps) if gap < tie_gap), len(gaps))


def served_greedy(url: str, model: str) -> list[tuple[list[int], list[float]]]:
    """vLLM's greedy tokens and their log-probabilities for every prompt (one request)."""
    resp = httpx.post(
        url + "/v1/completions",
        json={
            "model": model,
            "prompt": PROMPTS,
            "max_tokens": N_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "logprobs": 1,
        },
        timeout=600,
    )
    assert resp.status_code == 200, resp.text
    choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
    return [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in choices]


def assert_same_greedy(served: list, refs: list[Greedy], what: str) -> None:
    """Same tokens up to the first near tie of each prompt, and on those the same
    log-probabilities within LOGPROB_ATOL."""
    compared = 0
    worst = 0.0
    for p, ((tokens, logprobs), ref) in enumerate(zip(served, refs, strict=True)):
        n = compared_prefix(ref.gaps, TIE_GAP)
        assert tokens[:n] == ref.tokens[:n], f"{what}, prompt {p}: vLLM {tokens} != HF {ref.tokens}"
        errors = [abs(a - b) for a, b in zip(logprobs[:n], ref.logprobs[:n], strict=True)]
        worst = max(worst, *errors)
        assert max(errors) <= LOGPROB_ATOL, f"{what}, prompt {p}: logprob errors {errors}"
        compared += n
    print(f"{what}: {compared} tokens equal, logprobs within {worst:.1e}")
    assert compared >= len(refs) * N_TOKENS * 3 // 4, f"{what}: too many near ties"


def export_zoo(root: Path, names, *, adapters: bool) -> dict[str, dict]:
    """Per zoo model `name`: its checkpoint (`zoo`), the training side's stepped export
    (`full`, with the tiny model's tokenizer copied beside it: the zoo has none), its PEFT
    adapter (`adapter`, when `adapters`), the training side's summary and a server log path.
    Runs `zoo_train_side.py` once in `.venv-train` for all of them."""
    from support.model_zoo import checkpoint
    from support.vllm_server import tiny_paths

    assert TRAIN_PYTHON.exists(), f"{TRAIN_PYTHON} missing: run `make train-env` first"
    zoo = {name: checkpoint(name, root / "zoo") for name in names}
    cmd = [str(TRAIN_PYTHON), str(TRAIN_SIDE), "--out", str(root / "out")]
    for name, path in zoo.items():
        cmd += ["--model" if adapters else "--full-only", f"{name}={path}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"training side failed:\n{proc.stderr[-4000:]}"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    tiny_model, _ = tiny_paths()
    out = {}
    for name, ckpt in zoo.items():
        full = root / "out" / name / "full"
        for f in TOKENIZER_FILES:
            if (tiny_model / f).exists():
                shutil.copy(tiny_model / f, full / f)
        out[name] = {
            "zoo": ckpt,
            "full": full,
            "summary": summary[name],
            "log": root / f"vllm-{name}.log",
        }
        if adapters:
            out[name]["adapter"] = root / "out" / name / "adapter"
    return out


def load_export(full: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded export directory (`write_hf_checkpoint`'s index and shards)."""
    from safetensors.torch import load_file

    index = json.loads((full / "model.safetensors.index.json").read_text())
    got = {}
    for shard in sorted(set(index["weight_map"].values())):
        got.update(load_file(full / shard))
    return got


def stop_started(starts: dict, pool) -> None:
    """Stop every server whose start (a future of `serve_process.start`) succeeded, also
    after another one failed; then shut the start pool down."""
    for future in starts.values():
        try:
            server = future.result()
        except Exception:  # a failed start stopped itself; its error is raised by the caller
            continue
        server.stop()
    pool.shutdown(wait=True)
