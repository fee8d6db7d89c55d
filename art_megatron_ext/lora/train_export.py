"""Train LoRA for a few steps on a Megatron GPT shaped like a HF model, export it for PEFT.

Why: the cross-environment check (and anyone wanting an adapter made by the Megatron side
for the tiny model) needs one command on the training side:

    .venv-train/bin/python -m art_megatron_ext.lora.train_export \
        --hf-model .cache/tiny/model --out /tmp/adapter --steps 3 --deltas /tmp/deltas.safetensors

It runs on CPU in one process (gloo world of 1), loads the HF base weights into the Megatron
model (`--random-base` skips that), trains slot `default` (fresh, or loaded from
`--init-adapter PEFT_DIR`) with Adam on seeded random tokens (padding cleaned every step),
writes the PEFT directory, and with `--deltas` writes, for every HF module, a fixed input and
the Megatron site's LoRA delta for it (`<module>.input`, `<module>.delta`), plus the training
tokens and the trained model's logits for them, so the serving side can compare against
`peft`. Prints a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

TOKENS_KEY = "__tokens__"  # in the deltas file: the token ids [batch, seq] ...
LOGITS_KEY = "__logits__"  # ... and the trained model's logits for them [batch, seq, vocab]


@dataclass(frozen=True)
class TrainExportConfig:
    hf_model: str
    out: str
    steps: int = 3
    rank: int = 8
    alpha: float = 16.0
    lr: float = 1e-2
    seed: int = 0
    batch: int = 2
    seq_len: int = 32
    slot: str = "default"
    base_model_name: str | None = None
    deltas: str | None = None
    random_base: bool = False
    init_adapter: str | None = None

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch < 1 or self.seq_len < 2:
            raise ValueError(f"steps, batch must be >= 1 and seq_len >= 2: {self}")


def _sites_deltas(model, slot: str, seed: int) -> dict[str, torch.Tensor]:
    """`<hf module>.input` / `.delta` for every HF module of `slot` (single process)."""
    from .hf_layout import hf_modules, split_fused_b
    from .site import seeded_generator
    from .sites import iter_lora_sites

    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for entry in iter_lora_sites(model):
            if entry.slot != slot:
                continue
            info = entry.site.info
            g = seeded_generator(seed, "deltas", info.stable_key)
            x = torch.randn(4, info.in_features, generator=g).to(entry.adapter.a.dtype)
            delta = entry.site.delta(x, entry.adapter)
            parts = split_fused_b(info, [delta.T])
            for module, part in zip(hf_modules(info), parts, strict=True):
                out[f"{module}.input"] = x.clone()
                out[f"{module}.delta"] = part.T.contiguous()
    return out


def train_and_export(cfg: TrainExportConfig) -> dict:
    """Build, load, attach, train, export; returns a summary (losses, paths, counts)."""
    from megatron.core import parallel_state

    from .attach import attach_lora
    from .config import LoraConfig
    from .cpu_runtime import causal_mask, cpu_megatron
    from .export import export_peft
    from .hf_weights import load_hf_weights
    from .sites import zero_lora_padding_
    from .slot_ops import import_peft
    from .slots import activate_slot
    from .tiny_gpt import GptShape, build_gpt

    shape = GptShape.from_hf_config(cfg.hf_model)
    with tempfile.TemporaryDirectory(prefix="art_lora_") as tmp:
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1
        )
        parallel_state.initialize_model_parallel(1, 1)
        try:
            with cpu_megatron():
                torch.manual_seed(cfg.seed)
                model = build_gpt(shape)
                if not cfg.random_base:
                    load_hf_weights(model, cfg.hf_model, shape)
                attach_lora(
                    model,
                    LoraConfig(rank=cfg.rank, alpha=cfg.alpha, init_seed=cfg.seed, slot=cfg.slot),
                )
                if cfg.init_adapter:  # start from an existing PEFT adapter (e.g. an SFT one)
                    import_peft(model, cfg.slot, cfg.init_adapter)
                params = [p for p in model.parameters() if p.requires_grad]
                optimizer = torch.optim.Adam(params, lr=cfg.lr)
                g = torch.Generator().manual_seed(cfg.seed)
                tokens = torch.randint(0, shape.vocab_size, (cfg.batch, cfg.seq_len), generator=g)
                positions = torch.arange(cfg.seq_len).expand(cfg.batch, cfg.seq_len)
                mask = causal_mask(cfg.seq_len)
                losses = []
                for _ in range(cfg.steps):
                    with activate_slot(model, cfg.slot):
                        loss = model(
                            tokens[:, :-1],
                            positions[:, :-1],
                            mask[..., :-1, :-1],
                            labels=tokens[:, 1:],
                        ).mean()
                    loss.backward()
                    zero_lora_padding_(model, optimizer)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    zero_lora_padding_(model, optimizer)
                    losses.append(loss.item())
                name = cfg.base_model_name or str(Path(cfg.hf_model).resolve())
                out = export_peft(model, cfg.slot, cfg.out, name)
                summary = {"adapter": str(out), "losses": losses, "sites": len(params) // 2}
                if cfg.deltas:
                    from safetensors.torch import save_file

                    deltas = _sites_deltas(model, cfg.slot, cfg.seed)
                    with torch.no_grad(), activate_slot(model, cfg.slot):
                        logits = model(tokens, positions, mask)
                    deltas[TOKENS_KEY], deltas[LOGITS_KEY] = tokens, logits.float().contiguous()
                    save_file(deltas, cfg.deltas)
                    summary["deltas"] = cfg.deltas
                    summary["delta_modules"] = sum(k.endswith(".delta") for k in deltas)
        finally:
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()
    return summary


def parse_args(argv: list[str] | None = None) -> TrainExportConfig:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    fields = TrainExportConfig.__dataclass_fields__
    parser.add_argument("--hf-model", required=True, help="HF model dir (config.json)")
    parser.add_argument("--out", required=True, help="PEFT adapter directory to write")
    for name in ("steps", "rank", "seed", "batch", "seq_len"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=fields[name].default)
    for name in ("alpha", "lr"):
        parser.add_argument(f"--{name}", type=float, default=fields[name].default)
    parser.add_argument("--slot", default=fields["slot"].default)
    parser.add_argument("--base-model-name", default=None, help="adapter_config base name")
    parser.add_argument("--deltas", default=None, help="write per-module LoRA deltas here")
    parser.add_argument("--random-base", action="store_true", help="skip loading HF weights")
    parser.add_argument("--init-adapter", default=None, help="PEFT dir to start the slot from")
    return TrainExportConfig(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    summary = train_and_export(cfg)
    print(json.dumps({"config": asdict(cfg), **summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
