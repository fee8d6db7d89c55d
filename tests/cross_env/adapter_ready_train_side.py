"""Training-environment side of `test_adapter_ready.py`: train, `export_ready`, print the ready.

Run with `.venv-train/bin/python tests/cross_env/adapter_ready_train_side.py --hf-model DIR
--root ROOT --versions 1 2`: a Megatron GPT with the tiny model's shape and weights gets LoRA
(slot `policy`, r=8) and, per version, one Adam step on seeded tokens and an atomic
`export_ready` to `ROOT/policy/v<N>`. Prints one JSON list of the `AdapterReady` fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO)]


def run(hf_model: str, root: str, versions: list[int]) -> list[dict]:
    from megatron.core import parallel_state

    from art_megatron_ext.lora import LoraConfig, activate_slot, attach_lora, zero_lora_padding_
    from art_megatron_ext.lora.cpu_runtime import causal_mask, cpu_megatron
    from art_megatron_ext.lora.hf_weights import load_hf_weights
    from art_megatron_ext.lora.publish_ready import export_ready
    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt

    shape = GptShape.from_hf_config(hf_model)
    out = []
    with tempfile.TemporaryDirectory(prefix="art_ready_") as tmp:
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{tmp}/rdzv", rank=0, world_size=1
        )
        parallel_state.initialize_model_parallel(1, 1)
        with cpu_megatron():
            torch.manual_seed(0)
            model = build_gpt(shape)
            load_hf_weights(model, hf_model, shape)
            attach_lora(model, LoraConfig(rank=8, alpha=16.0, slot="policy"))
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.Adam(params, lr=1e-2)
            g = torch.Generator().manual_seed(0)
            tokens = torch.randint(0, shape.vocab_size, (2, 33), generator=g)
            positions = torch.arange(32).expand(2, 32)
            for version in versions:
                with activate_slot(model, "policy"):
                    loss = model(tokens[:, :-1], positions, causal_mask(32), labels=tokens[:, 1:])
                loss.mean().backward()
                zero_lora_padding_(model, optimizer)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                zero_lora_padding_(model, optimizer)
                ready = export_ready(
                    model,
                    "policy",
                    root,
                    version=version,
                    step=version,
                    base_model_name_or_path=hf_model,
                )
                out.append(dataclasses.asdict(ready))
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-model", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--versions", type=int, nargs="+", required=True)
    args = parser.parse_args()
    print(json.dumps(run(args.hf_model, args.root, args.versions)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
