"""Training-environment side of the MoE parity check (`test_moe_parity.py` runs it).

Run with `.venv-train/bin/python tests/cross_env/moe_megatron_side.py --hf-model DIR
--prompts prompts.json --out dump.safetensors`. It builds the Megatron GPT of the HF Qwen3-MoE
checkpoint (`art_megatron_ext.lora.hf_moe_weights`, fp32, TP = EP = 1, CPU shim from
`tests/support/megatron_cpu.py`), runs each prompt (a list of token ids) alone and writes,
per prompt p: `p{p}.logits` [seq, vocab] and, per MoE layer L, `p{p}.L{L}.router_logits`
[seq, experts] (fp32, the router's input times its weight) and `p{p}.L{L}.experts`
[seq, experts] (bool, the experts the router selected).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]


def run(hf_model: str, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    from megatron.core import parallel_state
    from support.megatron_cpu import cpu_shim

    from art_megatron_ext.lora.cpu_runtime import causal_mask, cpu_megatron
    from art_megatron_ext.lora.hf_moe_weights import MoeShape, build_moe_gpt, load_hf_moe_weights

    shape = MoeShape.from_hf_config(hf_model)
    out: dict[str, torch.Tensor] = {}
    with tempfile.TemporaryDirectory(prefix="art_moe_") as tmp:
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1
        )
        parallel_state.initialize_model_parallel(1, 1)
        try:
            with cpu_shim(), cpu_megatron(), torch.no_grad():
                torch.manual_seed(0)
                model = build_moe_gpt(shape).eval()
                load_hf_moe_weights(model, hf_model, shape)
                captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

                def hook(layer: int):
                    def fn(router, args, output):
                        logits = torch.nn.functional.linear(args[0].float(), router.weight.float())
                        captured[layer] = (logits.reshape(-1, shape.num_experts), output[1])

                    return fn

                for layer in shape.moe_layers:
                    router = model.decoder.layers[layer].mlp.router
                    router.register_forward_hook(hook(layer))
                for p, ids in enumerate(prompts):
                    tokens = torch.tensor([ids])
                    positions = torch.arange(len(ids))[None]
                    logits = model(tokens, positions, causal_mask(len(ids)))
                    out[f"p{p}.logits"] = logits[0].float().contiguous()
                    for layer, (router_logits, routing_map) in captured.items():
                        out[f"p{p}.L{layer}.router_logits"] = router_logits.contiguous()
                        out[f"p{p}.L{layer}.experts"] = routing_map.bool().contiguous()
                    captured.clear()
        finally:
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-model", required=True)
    parser.add_argument("--prompts", required=True, type=Path)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    from safetensors.torch import save_file

    prompts = json.loads(args.prompts.read_text())
    dump = run(args.hf_model, prompts)
    save_file(dump, args.out)
    print(json.dumps({"prompts": len(prompts), "tensors": len(dump)}))


if __name__ == "__main__":
    main()
