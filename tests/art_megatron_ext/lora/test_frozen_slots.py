"""A trained and a frozen LoRA slot under Megatron DDP + DistributedOptimizer (DP=2, gloo).

One spawn of 2 ranks: a tiny LoRA GPT with slot `policy` (trained) and slot `ref` (frozen,
non-zero B, declared with `apply_slot_training` before DDP wraps the model) takes two
AdamW steps (weight decay on) through Megatron's own `get_forward_backward_func()`, with and
without `overlap_grad_reduce` / `overlap_param_gather`. A control run declares nothing (both
slots train, as before `SlotTraining` existed): weight decay then moves the unused `ref`, and
with overlap Megatron's bucket reset asserts at step 2.
"""

from __future__ import annotations

import sys
import traceback

import numpy as np
import pytest
import torch
from support.distopt_model import SEQ, SHAPE, global_batch, scheduled_step, wrap_overlapped
from support.train_ranks import run_ranks


def _snapshot(model, slot: str) -> dict:
    from art_megatron_ext.lora import iter_lora_sites

    return {
        f"{e.path}.{n}": p.detach().clone().numpy()
        for e in iter_lora_sites(model)
        if e.slot == slot
        for n, p in e.tensors
    }


def _params(model, slot: str) -> list:
    from art_megatron_ext.lora import iter_lora_sites

    return [p for e in iter_lora_sites(model) if e.slot == slot for _, p in e.tensors]


def _build(declare: bool, out: dict):
    from art_megatron_ext.lora import LoraConfig, add_slot, attach_lora, iter_lora_sites
    from art_megatron_ext.lora.padding import logical_view
    from art_megatron_ext.lora.slot_training import SlotTraining, apply_slot_training
    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt

    torch.manual_seed(0)
    model = build_gpt(GptShape(**SHAPE))
    attach_lora(model, LoraConfig(rank=8, alpha=16.0, slot="policy"))
    add_slot(model, "ref", 8, 16.0, seed=1)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for e in iter_lora_sites(model):
            if e.slot == "ref":
                view = logical_view(e.adapter.b)
                view.copy_(torch.randn(view.shape, generator=g) * 0.05)
    if declare:
        try:
            apply_slot_training(model, SlotTraining(trained=("policy",)))
        except ValueError as exc:
            out["unnamed_refused"] = str(exc)
        apply_slot_training(model, SlotTraining(trained=("policy",), frozen=("ref",)))
    return model


def _train(rank: int, overlap: bool, declare: bool, steps: int) -> dict:

    from art_megatron_ext import compat
    from art_megatron_ext.lora import activate_slot, finish_lora_param_sync
    from art_megatron_ext.lora.cpu_runtime import causal_mask
    from art_megatron_ext.lora.slot_training import (
        SlotTraining,
        SlotTrainingAfterWrap,
        apply_slot_training,
    )

    out: dict = {}
    model = _build(declare, out)
    mask = causal_mask(SEQ)
    tokens = global_batch(0)[rank : rank + 1]
    positions = torch.arange(SEQ).expand(1, SEQ)

    def ref_loss() -> float:
        with torch.no_grad(), activate_slot(model, "ref"):
            return float(model(tokens[:, :-1], positions, mask, labels=tokens[:, 1:]).mean())

    out["ref_before"] = _snapshot(model, "ref")
    out["policy_before"] = _snapshot(model, "policy")
    out["ref_loss_before"] = ref_loss()
    ddp, optimizer = wrap_overlapped(model, overlap, 1200, weight_decay=0.1)
    if declare:
        apply_slot_training(model, SlotTraining(trained=("policy",), frozen=("ref",)))  # no-op
        try:
            apply_slot_training(model, SlotTraining(trained=("policy", "ref")))
        except SlotTrainingAfterWrap as exc:
            out["late_refused"] = str(exc)
    owned = set()
    for part in compat.chained_parts(optimizer):
        owned.update(compat.distopt_model_params(part))
    for slot in ("policy", "ref"):
        params = _params(model, slot)
        out[f"{slot}_in_buffers"] = [p in ddp.param_to_bucket_group for p in params]
        out[f"{slot}_in_optimizer"] = [p in owned for p in params]
    for step in range(steps):
        with activate_slot(model, "policy"):
            scheduled_step(ddp, optimizer, global_batch(step)[rank : rank + 1])
    finish_lora_param_sync(model)
    out["ref_after"] = _snapshot(model, "ref")
    out["ref_loss_after"] = ref_loss()
    out["policy_after"] = _snapshot(model, "policy")
    if declare:  # a frozen slot reloaded with another shape stays frozen
        site = next(m for m in model.modules() if hasattr(m, "slots") and "ref" in m.slots)
        (ra, ca), (rb, cb) = site.logical_shapes(4)
        site.load_slot("ref", torch.zeros(ra, ca), torch.zeros(rb, cb), 8.0)
        out["reloaded_ref_requires_grad"] = site.slots["ref"].a.requires_grad
    return out


def _worker(rank: int, world_size: int) -> dict:
    from megatron.core import parallel_state
    from support.megatron_cpu import cpu_shim, cuda_tensor_type_names

    from art_megatron_ext.lora.cpu_runtime import cpu_megatron

    out = {}
    with cpu_shim(), cuda_tensor_type_names(), cpu_megatron():
        parallel_state.initialize_model_parallel(1, 1)
        try:
            for name, overlap, declare, steps in (
                ("plain", False, True, 2),  # step 2 is where an unused slot's bucket asserts
                ("overlap", True, True, 2),
                ("undeclared", False, False, 1),  # one step of weight decay suffices
            ):
                out[name] = _train(rank, overlap, declare, steps)
            try:  # control: the unused slot's bucket never completes its gradients
                _train(rank, True, False, 2)
                out["undeclared_overlap"] = "trained without error"
            except AssertionError:
                out["undeclared_overlap"] = traceback.extract_tb(sys.exc_info()[2])[-1].name
        finally:
            parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_worker, 2, timeout_s=300, daemon=False)


@pytest.mark.parametrize("case", ["plain", "overlap"])
def test_frozen_slot_is_outside_the_buffers_and_the_optimizer(ranks, case):
    for r in ranks:
        assert not any(r[case]["ref_in_buffers"]) and all(r[case]["policy_in_buffers"])
        assert not any(r[case]["ref_in_optimizer"])
    r0, r1 = (r[case]["policy_in_optimizer"] for r in ranks)
    assert all(a or b for a, b in zip(r0, r1, strict=True))  # each rank owns a shard of some


@pytest.mark.parametrize("case", ["plain", "overlap"])
def test_frozen_slot_stays_bit_identical_across_steps(ranks, case):
    for rank, r in enumerate(ranks):
        before, after = r[case]["ref_before"], r[case]["ref_after"]
        assert before.keys() == after.keys() and len(before) == 16
        for name, value in before.items():
            np.testing.assert_array_equal(after[name], value, err_msg=f"rank {rank}: {name}")
        assert r[case]["ref_loss_after"] == r[case]["ref_loss_before"]


def test_trained_slot_trains_identically_with_and_without_overlap(ranks):
    r0 = ranks[0]
    reference, initial = r0["plain"]["policy_after"], r0["plain"]["policy_before"]
    assert all(not np.array_equal(reference[k], initial[k]) for k in reference)
    for name, value in reference.items():
        for rank, r in enumerate(ranks):
            for case in ("plain", "overlap"):
                got = r[case]["policy_after"][name]
                np.testing.assert_array_equal(got, value, err_msg=f"rank {rank} {case}: {name}")


def test_undeclared_unused_slot_is_moved_by_weight_decay(ranks):
    r = ranks[0]["undeclared"]
    assert all(r["ref_in_buffers"])
    moved = [k for k, v in r["ref_before"].items() if not np.array_equal(r["ref_after"][k], v)]
    assert moved


def test_undeclared_unused_slot_breaks_overlapped_grad_reduce_at_step_2(ranks):
    """Megatron's bucket `reset()` asserts that every parameter's gradient arrived."""
    assert [r["undeclared_overlap"] for r in ranks] == ["reset", "reset"]


def test_slot_training_names_every_slot_and_is_fixed_once_ddp_wraps(ranks):
    r = ranks[0]["plain"]
    assert "model slots it leaves out: ['ref']" in r["unnamed_refused"]
    assert "['ref']" in r["late_refused"] and "before DistributedDataParallel" in r["late_refused"]
    assert r["reloaded_ref_requires_grad"] is False


def test_slot_training_rejects_bad_declarations():
    from art_megatron_ext.lora.slot_training import SlotTraining

    with pytest.raises(ValueError, match=r"\['a'\] are listed as both"):
        SlotTraining(trained=("a",), frozen=("a", "b"))
    with pytest.raises(TypeError, match="tuple of slot names"):
        SlotTraining(trained="policy")
    with pytest.raises(ValueError, match="more than once"):
        SlotTraining(trained=("a", "a"))
    assert SlotTraining(trained=["a"]).trained == ("a",)
