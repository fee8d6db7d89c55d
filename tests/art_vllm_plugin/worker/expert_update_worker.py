"""One tensor-parallel rank of a real vLLM worker on CPU, updating an expert LoRA slot.

Run by `test_expert_adapter_update.py` (one process per rank): `python expert_update_worker.py
--model DIR --a DIR --b DIR --tp N --rank R --port P --out FILE [--mixed-3d]`.

Why a model runner and not a server: vLLM's CPU build has no path that runs expert LoRA (the
Triton MoE kernels need `_moe_C.moe_align_block_size`, and the CPU punica wrapper has no
`add_lora_w13`), so no server can serve it here (`worker/moe_lora_cpu.py`). What the worker
writes can still be checked: vLLM's `CPUModelRunner` builds the model with LoRA and its real
`FusedMoEWithLoRA` layers (never run), and its own LoRA manager loads adapters into them.

The rank: loads adapter `a` as LoRA id 1 (stacked index 0) and `b` as id 2 (index 1) the way
vLLM activates an adapter; then updates id 1 to `b` through the plugin's worker calls (stage
on the staging thread, commit); then compares index 0 with index 1 of every stacked tensor of
every LoRA layer, bit for bit. It also stages `b` once more with a stand-in device copy (a
clone: there is no device here) and counts the bytes that would go to the device. It writes
one JSON object to `--out`:

- `commit`: the commit's answer; `stage_error`: the staging error, if any;
- `compared`: stacked tensors compared; `differ`: those whose index 0 and 1 differ;
- `changed`: expert tensors whose index 0 changed with the update (a and b differ);
- `device_bytes`: bytes the staged copy moves; `whole_bytes`: bytes of the whole packed adapter.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: Stacked tensors of a LoRA layer, [max_loras, ...] each (an expert layer's `lora_a_stacked`
#: is a flat list of per-expert views into its w13/w2 tensors: those are compared instead).
STACKED = ("lora_a_stacked", "lora_b_stacked")
EXPERT_STACKED = ("w13_lora_a_stacked", "w13_lora_b_stacked", "w2_lora_a_stacked")
EXPERT_STACKED += ("w2_lora_b_stacked",)


def _build_runner(args):
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    config = EngineArgs(
        model=args.model,
        enforce_eager=True,
        enable_lora=True,
        max_lora_rank=8,
        max_loras=2,
        max_cpu_loras=2,
        max_model_len=256,
        max_num_seqs=4,
        tensor_parallel_size=args.tp,
        enable_mixed_moe_lora_format=args.mixed_3d,
    ).create_engine_config()
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=args.tp,
            rank=args.rank,
            distributed_init_method=f"tcp://127.0.0.1:{args.port}",
            local_rank=args.rank,
            backend="gloo",
        )
        initialize_model_parallel(args.tp, 1)
        runner = CPUModelRunner(config, torch.device("cpu"))
        runner.load_model()
    # The plugin's worker hooks, as a worker process has them. After the model is built: on
    # the CPU platform they include `moe_lora_cpu`, which refuses to build expert LoRA layers
    # (this CPU build cannot run them) and lets the built ones load adapters.
    from art_vllm_plugin import install

    install.install_worker()
    return runner


def _stacked(manager) -> dict[str, object]:
    out = {}
    for name, module in manager.modules.items():
        attrs = EXPERT_STACKED if hasattr(module, "w13_lora_a_stacked") else STACKED
        for attr in attrs:
            tensors = getattr(module, attr, None)
            if tensors is None:
                continue
            if not isinstance(tensors, list | tuple):  # one tensor (embeddings)
                tensors = [tensors]
            for i, t in enumerate(tensors):
                out[f"{name}.{attr}[{i}]"] = t
        if hasattr(module, "adapter_enabled"):
            out[f"{name}.adapter_enabled"] = module.adapter_enabled[:2].reshape(2, 1)
    return out


def _update_slot(runner, args) -> dict:
    from vllm.lora.request import LoRARequest

    from art_vllm_plugin.worker import lora_slot_writer
    from art_vllm_plugin.worker.state import worker_state

    worker = SimpleNamespace(model_runner=runner, rank=args.rank)
    loras = runner.lora_manager
    manager = loras._adapter_manager
    for lora_id, path in ((1, args.a), (2, args.b)):
        request = LoRARequest(f"r{lora_id}", lora_id, path, is_3d_lora_weight=args.mixed_3d)
        loras.add_adapter(request)
    assert manager.lora_index_to_id[:2] == [1, 2], manager.lora_index_to_id
    before = {k: t[0].clone() for k, t in _stacked(manager).items()}

    markers = Path(args.out).with_suffix(f".markers{args.rank}")
    markers.mkdir(exist_ok=True)
    lora_slot_writer.art_stage_lora_update(worker, "update", 1, "r1", args.b, str(markers))
    staged = worker_state(worker).staged["update"]
    assert staged.done.wait(120), "staging did not finish"
    result = {"stage_error": staged.error}
    result["commit"] = lora_slot_writer.art_commit_lora_update(worker, "update")

    import torch

    stacked = _stacked(manager)
    result["compared"] = sorted(stacked)
    result["differ"] = sorted(k for k, t in stacked.items() if not torch.equal(t[0], t[1]))
    result["changed"] = sorted(
        k for k, t in stacked.items() if "w13" in k or "w2" in k if not torch.equal(t[0], before[k])
    )
    return result


def _count_device_bytes(runner, args) -> dict:
    """Stage `b` again (vLLM's loader, packing, this rank's writes) with a clone standing in
    for the device copy."""
    from vllm.lora.request import LoRARequest

    from art_vllm_plugin.worker import slot_writes

    loras = runner.lora_manager
    manager = loras._adapter_manager
    model = loras._load_adapter(LoRARequest("b", 3, args.b, is_3d_lora_weight=args.mixed_3d))
    manager._create_merged_loras_inplace(model)
    moved = slot_writes.to_device(slot_writes.plan(manager, model), lambda t: t.clone())
    whole = 0
    for lora in model.loras.values():
        for x in (lora.lora_a, lora.lora_b):
            for t in x if isinstance(x, list) else [x]:
                whole += 0 if t is None else t.numel() * t.element_size()
    return {"device_bytes": moved.device_bytes, "whole_bytes": whole}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag in ("--model", "--a", "--b", "--out"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mixed-3d", action="store_true")
    args = parser.parse_args(argv)
    runner = _build_runner(args)
    result = _update_slot(runner, args)
    Path(args.out).write_text(json.dumps(result))  # the commit's answer, even if what follows fails
    result.update(_count_device_bytes(runner, args))
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
