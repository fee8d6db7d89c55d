"""The deterministic tiny model that the demo, tests and benchmarks serve.

Why: no model hub is reachable from our machines or CI, and a real `vllm serve` needs a real
checkpoint. This writes, from a seed and nothing else, a random-weight Llama small enough to
serve on two CPU cores (hidden 128, 2 layers, 4 heads, 2 KV heads, head_dim 32, bf16), a
byte-level BPE tokenizer trained here on generated text with a chat template, and three
different PEFT LoRA adapters (r=8 on every projection, non-zero B) so adapters really change
the generated tokens. Next to it, under `moe/`, a random-weight bf16 Qwen3-MoE with the same
tokenizer (hidden 128, 3 layers of which layer 0 is dense via `mlp_only_layers`, 8 experts,
top-2 with renormalized weights, expert FFN 64, dense FFN 256, head_dim 32, QK-norm): the MoE
model both vLLM (CPU MoE backend) and the Megatron side (`art_megatron_ext.lora.hf_moe_weights`)
build, so routes and logits can be compared across them. Running it twice gives
byte-identical files.

Usage: `python -m art_vllm_plugin.tiny_model --out .cache/tiny` (what `make tiny` runs).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ADAPTER_NAMES = ("a", "b", "c")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|eos|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
_WORDS = (
    "policy",
    "rollout",
    "reward",
    "token",
    "trainer",
    "adapter",
    "version",
    "update",
    "gradient",
    "advantage",
    "the",
    "a",
    "of",
    "and",
    "to",
    "in",
    "is",
    "it",
    "that",
    "for",
    "on",
    "with",
    "as",
    "was",
    "at",
    "by",
    "this",
    "be",
    "from",
    "or",
    "are",
    "model",
    "server",
    "request",
    "stream",
    "expert",
    "route",
    "batch",
    "prompt",
    "answer",
    "question",
    "step",
    "learn",
    "value",
    "state",
    "action",
    "agent",
    "environment",
    "episode",
    "group",
    "sample",
    "score",
)


@dataclass(frozen=True)
class TinyModelConfig:
    """Shape and seed of the tiny model; the defaults are what the project tests against."""

    seed: int = 1234
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 1024
    max_position_embeddings: int = 2048
    initializer_range: float = 0.05
    lora_rank: int = 8
    lora_alpha: int = 8
    corpus_lines: int = 4000
    adapters: tuple[str, ...] = field(default=ADAPTER_NAMES)
    moe_num_hidden_layers: int = 3
    moe_num_experts: int = 8
    moe_top_k: int = 2
    moe_intermediate_size: int = 64
    moe_dense_layers: tuple[int, ...] = (0,)


def _say(msg: str) -> None:
    print(f"[tiny] {msg}", flush=True)


def _corpus(cfg: TinyModelConfig) -> list[str]:
    """Generated text for the tokenizer: seeded words plus every printable ASCII character."""
    rng = random.Random(cfg.seed)
    lines = [
        " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))) + "."
        for _ in range(cfg.corpus_lines)
    ]
    lines.append("".join(chr(c) for c in range(32, 127)))
    lines.append("0123456789 " * 4)
    return lines


def write_tokenizer(cfg: TinyModelConfig, out: Path) -> int:
    """Train a byte-level BPE tokenizer and save it with the chat template; returns vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(cfg), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=cfg.max_position_embeddings,
    )
    fast.save_pretrained(out)
    return tok.get_vocab_size()


def write_model(cfg: TinyModelConfig, vocab_size: int, out: Path):
    """Random-weight bf16 Llama from the seed; returns the fp32 model for adapter creation."""
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    hf_cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.hidden_size // cfg.num_attention_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        initializer_range=cfg.initializer_range,
        tie_word_embeddings=False,
        bos_token_id=tok.token_to_id("<|bos|>"),
        eos_token_id=tok.token_to_id("<|eos|>"),
        pad_token_id=tok.token_to_id("<|pad|>"),
        torch_dtype="bfloat16",
    )
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(hf_cfg).eval()
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return model


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def write_moe_model(cfg: TinyModelConfig, vocab_size: int, tokenizer_dir: Path, out: Path) -> None:
    """Random-weight bf16 Qwen3-MoE from the seed, with the dense model's tokenizer files.

    Layer `moe_dense_layers` use a dense SwiGLU MLP (`mlp_only_layers`), the others route each
    token to `moe_top_k` of `moe_num_experts` experts (softmax, top-k, renormalized)."""
    import torch
    from tokenizers import Tokenizer
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    out.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copyfile(tokenizer_dir / name, out / name)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    hf_cfg = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.moe_num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.hidden_size // cfg.num_attention_heads,
        num_experts=cfg.moe_num_experts,
        num_experts_per_tok=cfg.moe_top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=list(cfg.moe_dense_layers),
        max_position_embeddings=cfg.max_position_embeddings,
        initializer_range=cfg.initializer_range,
        tie_word_embeddings=False,
        bos_token_id=tok.token_to_id("<|bos|>"),
        eos_token_id=tok.token_to_id("<|eos|>"),
        pad_token_id=tok.token_to_id("<|pad|>"),
        torch_dtype="bfloat16",
    )
    torch.manual_seed(cfg.seed + 7)
    model = Qwen3MoeForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # norms away from 1, so a swapped or dropped norm shows in parity
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn(param.shape))
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)


def write_adapter(cfg: TinyModelConfig, model_dir: Path, index: int, out: Path) -> None:
    """One PEFT LoRA adapter with random A and B (init_lora_weights=False), seeded per name."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    torch.manual_seed(cfg.seed + 1000 * (index + 1))
    lora_cfg = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        target_modules=list(LORA_TARGETS),
        lora_dropout=0.0,
        bias="none",
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(base, lora_cfg)
    peft_model.save_pretrained(out, safe_serialization=True)
    # PEFT records the absolute base path; keep the files independent of where they were made.
    cfg_path = out / "adapter_config.json"
    data = json.loads(cfg_path.read_text())
    data["base_model_name_or_path"] = "art-tiny-llama"
    # PEFT stores target_modules from a set: sort it so the file is byte-identical across runs.
    data["target_modules"] = sorted(data["target_modules"])
    cfg_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    readme = out / "README.md"
    if readme.exists():
        readme.unlink()


def generate(out_root: Path, cfg: TinyModelConfig | None = None) -> Path:
    """Write model and adapters under out_root (replacing what is there); returns out_root."""
    cfg = cfg or TinyModelConfig()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own numbered steps are the progress output
    t0 = time.monotonic()
    tmp = out_root.with_name(out_root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model_dir = tmp / "model"
    model_dir.mkdir(parents=True)
    _say(f"1/4 training a byte-level BPE tokenizer (vocab {cfg.vocab_size}, seed {cfg.seed})")
    vocab = write_tokenizer(cfg, model_dir)
    _say(
        f"2/4 writing a random bf16 Llama: hidden {cfg.hidden_size}, "
        f"{cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads, "
        f"{cfg.num_key_value_heads} KV heads, vocab {vocab}"
    )
    write_model(cfg, vocab, model_dir)
    for i, name in enumerate(cfg.adapters):
        _say(
            f"3/4 writing PEFT adapter {name!r} ({i + 1}/{len(cfg.adapters)}): r={cfg.lora_rank}, "
            f"targets {','.join(LORA_TARGETS)}"
        )
        write_adapter(cfg, model_dir, i, tmp / "adapters" / name)
    _say(
        f"4/4 writing a random bf16 Qwen3-MoE: hidden {cfg.hidden_size}, "
        f"{cfg.moe_num_hidden_layers} layers (dense: {list(cfg.moe_dense_layers)}), "
        f"{cfg.moe_num_experts} experts, top-{cfg.moe_top_k}, expert FFN "
        f"{cfg.moe_intermediate_size}"
    )
    write_moe_model(cfg, vocab, model_dir, tmp / "moe")
    (tmp / "tiny_config.json").write_text(json.dumps(asdict(cfg), indent=2, sort_keys=True) + "\n")
    shutil.rmtree(out_root, ignore_errors=True)
    tmp.rename(out_root)
    _say(
        f"done in {time.monotonic() - t0:.1f}s: {out_root}/model, {out_root}/adapters/"
        f"{{{','.join(cfg.adapters)}}}, {out_root}/moe"
    )
    return out_root


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".cache/tiny"))
    parser.add_argument("--seed", type=int, default=TinyModelConfig.seed)
    args = parser.parse_args(argv)
    generate(args.out, TinyModelConfig(seed=args.seed))


if __name__ == "__main__":
    main()
