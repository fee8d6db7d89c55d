"""Training-environment side of `test_model_zoo_serving.py`: step, export, attach LoRA, export.

Run with `.venv-train/bin/python tests/cross_env/zoo_train_side.py --model NAME=HF_DIR ...
--out ROOT` (and `--full-only NAME=HF_DIR` for a model that gets the step and no adapter: the
MoE families, whose LoRA the CPU build of vLLM does not serve). Per model, in one process (one
gloo world of 1, TP = 1, fp32, CPU; dense, Qwen3-MoE or DeepSeek-V3 by its `model_type`):
- `full`: the checkpoint is loaded into a Megatron GPT whose vocabulary is padded as Megatron
  trainers pad it (`make_vocab_size_divisible_by=128`), takes one Adam step on a cross-entropy
  over the real vocabulary columns only (the padded columns get no gradient, so their rows
  stay 0), and `write_hf_checkpoint` writes it to `ROOT/NAME/full` (padded rows trimmed, tied
  weights once); the checkpoint's `config.json` is copied beside it;
- `adapter`: the checkpoint loaded again (unstepped), LoRA attached (rank 8, alpha 16, every
  target: q/k/v, o, gate/up, down), B drawn at random (a fresh slot's B is 0, which would make
  the adapter a no-op), exported as a PEFT adapter to `ROOT/NAME/adapter`.
Prints one JSON object: per model the padded vocabulary, the loss, whether the padded rows
stayed 0, the stream's receipt and the number of LoRA sites.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO)]

DIVISIBLE = 128  # Megatron's default make_vocab_size_divisible_by
LORA_RANK, LORA_ALPHA = 8, 16.0
LORA_B_STD = 0.1  # large enough that the adapter changes greedy tokens
# Adam moves every weight by about LR: greedy tokens change, and the stepped models do not
# collapse into repeating one token (1e-2 did that to the tied Qwen2.5)
LR = 3e-3
BATCH, SEQ = 2, 32


def _build(hf_dir: str):
    """The checkpoint in its family's Megatron model: dense Llama/Qwen and DeepSeek-V3 with
    the vocabulary padded, Qwen3-MoE unpadded (its builder does not pad)."""
    from art_megatron_ext.lora.hf_config import read_config

    kind = read_config(hf_dir)["model_type"]
    torch.manual_seed(0)
    if kind == "qwen3_moe":
        from art_megatron_ext.lora.hf_moe_weights import (
            MoeShape,
            build_moe_gpt,
            load_hf_moe_weights,
        )

        shape = MoeShape.from_hf_config(hf_dir)
        model = build_moe_gpt(shape)
        load_hf_moe_weights(model, hf_dir, shape)
    elif kind == "deepseek_v3":
        from art_megatron_ext.lora.deepseek_gpt import build_deepseek_gpt
        from art_megatron_ext.lora.hf_deepseek import DeepseekShape
        from art_megatron_ext.lora.hf_deepseek_weights import load_hf_deepseek_weights

        shape = DeepseekShape.from_hf_config(hf_dir)
        model = build_deepseek_gpt(shape, make_vocab_size_divisible_by=DIVISIBLE)
        load_hf_deepseek_weights(model, hf_dir, shape)
    else:
        from art_megatron_ext.lora.hf_weights import load_hf_weights
        from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt

        shape = GptShape.from_hf_config(hf_dir)
        model = build_gpt(shape, make_vocab_size_divisible_by=DIVISIBLE)
        load_hf_weights(model, hf_dir, shape)
    return model, shape


def _forward(model, tokens: torch.Tensor) -> torch.Tensor:
    from art_megatron_ext.lora.cpu_runtime import causal_mask

    positions = torch.arange(tokens.shape[1])[None].expand_as(tokens)
    return model(tokens, positions, causal_mask(tokens.shape[1]))


def _padded_rows_zero(model, vocab: int) -> bool:
    params = dict(model.named_parameters())
    return all(
        bool((params[name][vocab:] == 0).all())
        for name in ("embedding.word_embeddings.weight", "output_layer.weight")
        if name in params
    )


def _full(hf_dir: str, out: Path) -> dict:
    """One Adam step on the real vocabulary's cross-entropy, then the HF checkpoint."""
    from art_megatron_ext.weights import write_hf_checkpoint

    model, shape = _build(hf_dir)
    vocab = shape.vocab_size
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(3, vocab, (BATCH, SEQ + 1), generator=g)
    logits = _forward(model, tokens[:, :-1])
    padded = logits.shape[-1]
    # The padded columns are left out of the softmax: weight 0, no gradient.
    loss = torch.nn.functional.cross_entropy(
        logits[..., :vocab].reshape(-1, vocab), tokens[:, 1:].reshape(-1)
    )
    loss.backward()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    optimizer.step()
    receipt = write_hf_checkpoint(model, shape, out)
    shutil.copy(Path(hf_dir) / "config.json", out / "config.json")
    return {
        "padded_vocab": padded,
        "loss": loss.item(),
        "padded_rows_zero": _padded_rows_zero(model, vocab),
        "receipt": {"tensors": receipt.tensors, "bytes": receipt.bytes, "digest": receipt.digest},
    }


def _adapter(hf_dir: str, out: Path, base_name: str) -> dict:
    """LoRA on every target of the loaded (unstepped) model, B random, exported for PEFT."""
    from art_megatron_ext.lora import (
        LoraConfig,
        attach_lora,
        export_peft,
        iter_lora_sites,
        zero_lora_padding_,
    )
    from art_megatron_ext.lora.padding import logical_view

    model, _ = _build(hf_dir)
    attach_lora(model, LoraConfig(rank=LORA_RANK, alpha=LORA_ALPHA, slot="zoo"))
    g = torch.Generator().manual_seed(13)
    sites = 0
    with torch.no_grad():
        for entry in iter_lora_sites(model):
            b = logical_view(entry.adapter.b)
            b.copy_(LORA_B_STD * torch.randn(b.shape, generator=g, dtype=b.dtype))
            sites += 1
    zero_lora_padding_(model)
    export_peft(model, "zoo", out, base_name)
    return {"lora_sites": sites}


def run(models: dict[str, str], root: Path, full_only: dict[str, str]) -> dict:
    from megatron.core import parallel_state

    from art_megatron_ext.cpu_stand_in import cpu_shim
    from art_megatron_ext.lora.cpu_runtime import cpu_megatron

    summary = {}
    with tempfile.TemporaryDirectory(prefix="art_zoo_") as tmp:
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{tmp}/rdzv", rank=0, world_size=1
        )
        parallel_state.initialize_model_parallel(1, 1)
        try:
            with cpu_megatron(), cpu_shim():  # MoE layers ask for CUDA streams
                for name, hf_dir in {**models, **full_only}.items():
                    out = root / name
                    out.mkdir(parents=True, exist_ok=True)
                    summary[name] = _full(hf_dir, out / "full")
                    if name in models:
                        lora = _adapter(hf_dir, out / "adapter", str(out / "full"))
                        summary[name].update(lora)
        finally:
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()
    return summary


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", action="append", default=[], help="NAME=HF_DIR")
    parser.add_argument(
        "--full-only", action="append", default=[], help="NAME=HF_DIR: the step, no adapter"
    )
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    models = dict(spec.split("=", 1) for spec in args.model)
    full_only = dict(spec.split("=", 1) for spec in args.full_only)
    print(json.dumps(run(models, args.out, full_only)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
