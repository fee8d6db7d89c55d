"""Write the model zoo and Hugging Face's fp32 logits on the zoo test's prompts.

Why: the bridge and our mapping are both judged against HF's own model code on the same
files. This writes every `tests/support/model_zoo.py` entry (bf16 safetensors, the zoo's
seeds), plus `qwen3-moe-allmoe` (the Qwen3-MoE entry with `mlp_only_layers=[]`, same
writer), and saves HF fp32 logits on `test_model_zoo._prompts()` as `DIR/hf_logits.pt`.

Run with the project's train venv and without the bridge on the path (HF models are loaded
in a clean process: loaded inside `cpu_shim()`, HF's rotary `inv_freq` comes out wrong):

    .venv-train/bin/python bench/bridge_eval/write_zoo.py --zoo /tmp/zoo
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers
from common import ALL_MOE, HF_LOGITS, use_repo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", type=Path, required=True, help="folder to write the zoo into")
    args = parser.parse_args()

    use_repo()
    import test_model_zoo
    from support import model_zoo

    cls_name, kwargs = model_zoo.ZOO["qwen3-moe"]
    model_zoo.ZOO[ALL_MOE] = (cls_name, dict(kwargs, mlp_only_layers=[]))
    prompts = test_model_zoo._prompts()
    out = {"prompts": prompts}
    for name in model_zoo.ZOO:
        path = model_zoo.write_checkpoint(name, args.zoo / name)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            out[name] = model.eval()(prompts).logits
        print(f"{name:18s} logits {tuple(out[name].shape)} transformers {transformers.__version__}")
    torch.save(out, args.zoo / HF_LOGITS)


if __name__ == "__main__":
    main()
