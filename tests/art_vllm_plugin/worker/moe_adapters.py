"""Two seeded LoRA adapters `a` and `b` for the tiny Qwen3-MoE, with expert weights.

Run by `test_expert_adapter_update.py` as `python moe_adapters.py --model DIR --out DIR
[--fused-3d]` (a process of its own: in the pytest process `art_megatron_ext` resolves to the
test folder of that name). Layouts:

- default: as `art_megatron_ext.lora.export` writes a Megatron MoE adapter: module names from
  `hf_layout` (`HfNaming`; one module per expert, `mlp.experts.<e>.{gate,up,down}_proj`), its
  `adapter_config`, every linear of every layer (dense layer 0 included) at rank 8;
- `--fused-3d`: the experts in vLLM's fused 3-D layout instead (`mlp.experts.base_layer` =
  gate_up `(rank*experts, hidden)` / `(2*inter, rank*experts)`, `mlp.experts` = down; read by
  `LoRAModelManager._convert_3d_to_2d_moe_lora`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

RANK = 8


def export_layout(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """HF key -> tensor of an adapter as the Megatron export names it (`hf_layout`)."""
    from art_megatron_ext.lora.hf_layout import PEFT_PREFIX, HfNaming

    g = torch.Generator().manual_seed(seed)
    naming = HfNaming()
    hidden, head = cfg["hidden_size"], cfg["head_dim"]
    q_out, kv_out = cfg["num_attention_heads"] * head, cfg["num_key_value_heads"] * head
    shapes: dict[str, tuple[int, int]] = {}
    for layer in range(cfg["num_hidden_layers"]):
        base = naming.layer.format(layer=layer)
        shapes[f"{base}.{naming.q}"] = (hidden, q_out)
        shapes[f"{base}.{naming.k}"] = (hidden, kv_out)
        shapes[f"{base}.{naming.v}"] = (hidden, kv_out)
        shapes[f"{base}.{naming.o}"] = (q_out, hidden)
        if layer in cfg["mlp_only_layers"]:
            inter = cfg["intermediate_size"]
            shapes[f"{base}.{naming.gate}"] = (hidden, inter)
            shapes[f"{base}.{naming.up}"] = (hidden, inter)
            shapes[f"{base}.{naming.down}"] = (inter, hidden)
            continue
        inter = cfg["moe_intermediate_size"]
        for e in range(cfg["num_local_experts"]):
            expert = f"{base}.{naming.expert.format(expert=e)}"
            shapes[f"{expert}.{naming.expert_gate}"] = (hidden, inter)
            shapes[f"{expert}.{naming.expert_up}"] = (hidden, inter)
            shapes[f"{expert}.{naming.expert_down}"] = (inter, hidden)
    out = {}
    for module, (n_in, n_out) in shapes.items():
        out[f"{PEFT_PREFIX}{module}.lora_A.weight"] = torch.randn(RANK, n_in, generator=g) * 0.05
        out[f"{PEFT_PREFIX}{module}.lora_B.weight"] = torch.randn(n_out, RANK, generator=g) * 0.05
    return out


def fused_3d_layout(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """The same adapter with the experts in vLLM's fused 3-D layout."""
    from art_megatron_ext.lora.hf_layout import PEFT_PREFIX

    tensors = {k: v for k, v in export_layout(cfg, seed).items() if ".experts." not in k}
    g = torch.Generator().manual_seed(seed + 100)
    hidden, inter, n = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_local_experts"]
    for layer in range(cfg["num_hidden_layers"]):
        if layer in cfg["mlp_only_layers"]:
            continue
        experts = f"{PEFT_PREFIX}model.layers.{layer}.mlp.experts"
        for module, n_in, n_out in ((".base_layer", hidden, 2 * inter), ("", inter, hidden)):
            a = torch.randn(RANK * n, n_in, generator=g) * 0.05
            b = torch.randn(n_out, RANK * n, generator=g) * 0.05
            tensors[f"{experts}{module}.lora_A.weight"] = a
            tensors[f"{experts}{module}.lora_B.weight"] = b
    return tensors


def write_adapter(path: Path, tensors: dict[str, torch.Tensor], base_model: str) -> Path:
    from safetensors.torch import save_file

    from art_megatron_ext.lora.export import adapter_config

    path.mkdir(parents=True)
    # the targets as the export derives them (the module names' last part)
    targets = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors} - {"base_layer"})
    config = adapter_config(RANK, 2 * RANK, targets, base_model)
    (path / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--fused-3d", action="store_true")
    args = parser.parse_args(argv)
    cfg = json.loads((args.model / "config.json").read_text())
    layout = fused_3d_layout if args.fused_3d else export_layout
    for name, seed in (("a", 1), ("b", 2)):
        write_adapter(args.out / name, layout(cfg, seed), str(args.model))


if __name__ == "__main__":
    main()
