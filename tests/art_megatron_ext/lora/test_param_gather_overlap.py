"""LoRA under Megatron DDP with `overlap_grad_reduce` and `overlap_param_gather` (DP=2, gloo).

One spawn of 2 ranks trains the same tiny LoRA GPT twice through Megatron's own
`get_forward_backward_func()` and `DistributedOptimizer`, with buckets small enough that the
LoRA parameters span several bucket groups: once without overlap (the reference: the
optimizer all-gathers parameters right after its step) and once with both overlaps (the
all-gather is left to the forward pre-hooks of the modules that own the parameters). Right
after step 4 each run exports the slot with `export_peft`, and right after step 5 takes the
model's `sharded_state_dict()` (what a dist-checkpoint save writes): both must finish the
pending all-gather first. Equal losses, equal LoRA parameters on both ranks, equal
checkpoint entries and equal exports mean the LoRA parameters take part in Megatron's
parameter sync like base ones.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from support.distopt_model import SHAPE, global_batch, scheduled_step, wrap_overlapped
from support.train_ranks import run_ranks

STEPS = 4
BUCKET_SIZE = 1200  # elements: the 16 LoRA tensors (512-768 each) fill several buckets


def _train(rank: int, overlap: bool, export_dir: Path) -> dict:

    from art_megatron_ext.lora import LoraConfig, attach_lora, export_peft, iter_lora_sites
    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt

    torch.manual_seed(0)
    model = build_gpt(GptShape(**SHAPE))
    attach_lora(model, LoraConfig(rank=8, alpha=16.0))
    ddp, optimizer = wrap_overlapped(model, overlap, BUCKET_SIZE, weight_decay=0.0)

    def step(index: int) -> float:
        return scheduled_step(ddp, optimizer, global_batch(index)[rank : rank + 1])

    losses = [step(index) for index in range(STEPS)]
    export_peft(ddp.module, "default", export_dir, "tiny")  # right after the step
    losses.append(step(STEPS))
    checkpoint = {  # what a dist-checkpoint save right after the step would write
        key: entry.data.detach().clone().numpy()
        for key, entry in ddp.module.sharded_state_dict().items()
        if ".lora." in key
    }
    params = {
        f"{e.path}.{e.slot}.{n}": p.detach().clone().numpy()
        for e in iter_lora_sites(ddp.module)
        for n, p in e.tensors
    }
    buckets = {
        id(ddp.param_to_bucket_group[p]) for e in iter_lora_sites(ddp.module) for _, p in e.tensors
    }
    return {
        "losses": losses,
        "checkpoint": checkpoint,
        "params": params,
        "bucket_groups": len(buckets),
    }


def _worker(rank: int, world_size: int, root: str) -> dict:
    from megatron.core import parallel_state
    from support.megatron_cpu import cpu_shim, cuda_tensor_type_names

    from art_megatron_ext.lora.cpu_runtime import cpu_megatron

    out = {}
    with cpu_shim(), cuda_tensor_type_names(), cpu_megatron():
        parallel_state.initialize_model_parallel(1, 1)
        try:
            for overlap in (False, True):
                name = "overlap" if overlap else "plain"
                out[name] = _train(rank, overlap, Path(root) / name)
        finally:
            parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap")
    return root, run_ranks(_worker, 2, args=(str(root),), timeout_s=300, daemon=False)


def test_lora_spans_several_bucket_groups(runs):
    _, ranks = runs
    assert all(r["overlap"]["bucket_groups"] >= 3 for r in ranks)


def test_overlapped_losses_equal_the_plain_run_at_every_step(runs):
    _, ranks = runs
    for rank, r in enumerate(ranks):
        assert r["overlap"]["losses"] == r["plain"]["losses"], f"rank {rank}"


def test_lora_parameters_are_bitwise_equal_across_ranks_and_to_the_plain_run(runs):
    _, (r0, r1) = runs
    reference = r0["plain"]["params"]
    assert len(reference) == 16
    for name, value in reference.items():
        np.testing.assert_array_equal(r1["plain"]["params"][name], value, err_msg=name)
        for rank, r in enumerate((r0, r1)):
            got = r["overlap"]["params"][name]
            np.testing.assert_array_equal(got, value, err_msg=f"rank {rank}: {name}")


def test_checkpoint_entries_right_after_the_step_equal_the_plain_run(runs):
    _, ranks = runs
    for rank, r in enumerate(ranks):
        reference = r["plain"]["checkpoint"]
        assert reference.keys() == r["overlap"]["checkpoint"].keys() and len(reference) == 16
        for key, value in reference.items():
            got = r["overlap"]["checkpoint"][key]
            np.testing.assert_array_equal(got, value, err_msg=f"rank {rank}: {key}")


def test_export_right_after_the_step_equals_the_plain_export(runs):
    from safetensors.numpy import load_file

    root, _ = runs
    plain = load_file(root / "plain" / "adapter_model.safetensors")
    overlap = load_file(root / "overlap" / "adapter_model.safetensors")
    assert plain.keys() == overlap.keys() and len(plain) == 28
    differing = sorted(k for k in plain if not np.array_equal(plain[k], overlap[k]))
    assert differing == []
