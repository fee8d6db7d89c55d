"""Our HF <-> Megatron mapping on the zoo files that the bridge is measured on.

Why: the bridge's numbers mean something only next to ours on the same checkpoints and the
same saved HF logits. This runs the zoo test's rank worker (`test_model_zoo._worker`, not
pytest) at TP=1 and TP=2 on `--zoo`, and prints per model: the padded vocabulary, the largest
absolute logits difference to HF over the 1030 real columns, and whether the stream gives
back the checkpoint's tensors exactly; for the dense models also whether, after one training
step, the stream maps back bitwise onto every rank's parameters with the padded vocabulary rows
still 0. `qwen3-moe-allmoe` is run in the worker's
`qwen3-moe` slot (and its `-etp1` variant, experts whole on every rank, where the worker
runs one). Last, DeepSeek-V3 must be refused by name.

Run with the project's train venv, without the bridge on the path, after `write_zoo.py`:

    .venv-train/bin/python bench/bridge_eval/run_ours.py --zoo /tmp/zoo
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import ALL_MOE, HF_LOGITS, use_repo
from safetensors.torch import load_file

WORKER_MOE = "qwen3-moe"  # the worker's one MoE slot


def stream_exact(sent: list, checkpoint: Path) -> bool:
    """The streamed (name, array) pairs equal the checkpoint's tensors: names, shapes, values."""
    want = load_file(checkpoint / "model.safetensors")
    got = {name: torch.from_numpy(array) for name, array in sent}
    return sorted(got) == sorted(want) and all(
        got[k].shape == t.shape and torch.equal(got[k], t.float()) for k, t in want.items()
    )


def run(zoo: Path, moe: str, tps: tuple[int, ...]) -> None:
    """Print one line per model and TP, the MoE slot holding checkpoint `moe`."""
    import test_model_zoo
    from support.dist import run_ranks

    ref = torch.load(zoo / HF_LOGITS)
    if not torch.equal(ref["prompts"], test_model_zoo._prompts()):
        raise SystemExit(f"{zoo / HF_LOGITS} holds other prompts than test_model_zoo: rewrite it")
    dirs = {name: str(zoo / name) for name in (*test_model_zoo.DENSE, WORKER_MOE)}
    dirs[WORKER_MOE] = str(zoo / moe)
    for tp in tps:
        ranks = run_ranks(test_model_zoo._worker, world_size=tp, args=(dirs,), timeout_s=900)
        # (printed label, worker result key, checkpoint name)
        slots = [(n, n, n) for n in test_model_zoo.DENSE] if moe == WORKER_MOE else []
        slots.append((moe, WORKER_MOE, moe))
        if f"{WORKER_MOE}-etp1" in ranks[0]:
            slots.append((f"{moe}-etp1", f"{WORKER_MOE}-etp1", moe))
        for label, key, name in slots:
            rec = ranks[0][key]
            if "refused" in rec:
                print(f"{label:18s} tp{tp} refused: {rec['refused'][:100]}")
                continue
            logits = torch.from_numpy(rec["logits"])[..., : ref[name].shape[-1]]
            err = (logits - ref[name]).abs().max().item()
            exact = stream_exact(rec["loaded"][0], zoo / name)
            pad = rec.get("padded_vocab")
            line = f"{label:18s} tp{tp} padded_vocab={pad} logits_maxabs={err:.3g} exact={exact}"
            if "not_bitwise" in rec:  # dense models: one training step was taken
                step_ok = all(
                    r[key]["not_bitwise"] == [] and r[key]["padded_rows_zero"] for r in ranks
                )
                line += f" after_step_bitwise_pad0={step_ok}"
            print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", type=Path, required=True, help="folder written by write_zoo.py")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor parallel sizes")
    args = parser.parse_args()

    use_repo()
    from art_megatron_ext.lora.hf_config import UnmappedConfig
    from art_megatron_ext.lora.tiny_gpt import GptShape

    run(args.zoo, WORKER_MOE, tuple(args.tp))
    if (args.zoo / ALL_MOE).exists():
        run(args.zoo, ALL_MOE, tuple(args.tp))
    try:
        GptShape.from_hf_config(str(args.zoo / "deepseek-v3"))
    except UnmappedConfig as e:
        print(f"{'deepseek-v3':18s} refused: {str(e)[:160]}")
    else:
        print(f"{'deepseek-v3':18s} NOT refused")


if __name__ == "__main__":
    main()
