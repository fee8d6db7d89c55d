"""Grouped-expert LoRA saved at expert-TP=2 reloads at expert-TP=1 (2 gloo ranks, one spawn).

The grouped experts (TE grouped linears, stand-in of `support/te_standin.py`) are built at
TP=2 (expert-TP follows it) with a gated FC1 whose per-rank B rows (36 = [18 gate; 18 up])
are padded to 40, loaded into the same model at TP=1 (72 rows, no padding), saved there and
loaded back at TP=2 (logical rows into padded ones). The gathered
PEFT export, which is layout independent, must come back exactly. On the previous main the
stacked B was stored padded and in per-rank [gate; up] order: the load at TP=1 was refused
for the shape (80 vs 72 rows) or, without padding, silently mixed gate and up rows.
"""

from __future__ import annotations

import os

import pytest
import torch
from support.train_ranks import run_ranks

SHAPE = dict(
    hidden_size=32,
    intermediate_size=36,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=64,
)
EXPERTS = 4


def _build(tp: int):
    from megatron.core import parallel_state
    from support.te_standin import te_standin_layer_spec

    from art_megatron_ext.lora import LoraConfig, attach_lora
    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt

    parallel_state.initialize_model_parallel(tp, 1, expert_model_parallel_size=1)
    torch.manual_seed(0)
    model = build_gpt(
        GptShape(**SHAPE),
        tensor_parallel=tp,
        num_experts=EXPERTS,
        moe_grouped_gemm=True,
        layer_spec=te_standin_layer_spec(num_experts=EXPERTS, moe_grouped_gemm=True),
    )
    attach_lora(model, LoraConfig(rank=4, alpha=8.0))
    return model


def _experts_only(tensors: dict) -> dict:
    return {k: v for k, v in tensors.items() if ".experts." in k}


def _worker(rank: int, world_size: int, root: str) -> dict:
    from megatron.core import dist_checkpointing, parallel_state
    from support.megatron_cpu import cpu_shim

    from art_megatron_ext.lora import iter_lora_sites
    from art_megatron_ext.lora.cpu_runtime import cpu_megatron
    from art_megatron_ext.lora.export import collect_peft_tensors
    from art_megatron_ext.lora.padding import logical_view
    from art_megatron_ext.lora.site import seeded_generator

    def sharded(model):
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        return {
            k: v
            for k, v in model.sharded_state_dict(metadata={"dp_cp_group": group}).items()
            if ".lora." in k
        }

    out: dict = {}
    with cpu_shim(), cpu_megatron():
        try:
            model = _build(tp=2)
            with torch.no_grad():
                for entry in iter_lora_sites(model):
                    b = logical_view(entry.adapter.b)
                    info = entry.site.info
                    g = seeded_generator(5, info.stable_key, info.tp_rank)
                    b.copy_(torch.randn(b.shape, generator=g))
            out["padded_rows"] = sorted(
                {
                    tuple(e.adapter.b.shape)
                    for e in iter_lora_sites(model)
                    if ".experts.linear_fc1" in e.site.info.path
                }
            )
            before, _ = collect_peft_tensors(model, "default", dst=None)
            os.makedirs(f"{root}/tp2", exist_ok=True)
            dist_checkpointing.save(sharded(model), f"{root}/tp2")
        finally:
            parallel_state.destroy_model_parallel()
        try:
            model = _build(tp=1)
            fresh, _ = collect_peft_tensors(model, "default", dst=None)
            loaded = dist_checkpointing.load(sharded(model), f"{root}/tp2")
            model.load_state_dict(loaded, strict=False)
            after, _ = collect_peft_tensors(model, "default", dst=None)
            os.makedirs(f"{root}/tp1", exist_ok=True)
            dist_checkpointing.save(sharded(model), f"{root}/tp1")
        finally:
            parallel_state.destroy_model_parallel()
        try:  # and back: 72 logical rows into each rank's padded [18 + 18 -> 40] B
            model = _build(tp=2)
            model.load_state_dict(dist_checkpointing.load(sharded(model), f"{root}/tp1"), False)
            back, _ = collect_peft_tensors(model, "default", dst=None)
        finally:
            parallel_state.destroy_model_parallel()
    before, after, fresh, back = map(_experts_only, (before, after, fresh, back))
    out["differs_back_at_tp2"] = sorted(k for k in before if not torch.equal(before[k], back[k]))
    out["count"] = len(before)
    out["same_keys"] = before.keys() == after.keys()
    out["differs_after_load"] = sorted(k for k in before if not torch.equal(before[k], after[k]))
    out["fresh_differs"] = sum(not torch.equal(before[k], fresh[k]) for k in before)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("grouped_etp")
    return run_ranks(_worker, world_size=2, args=(str(root),), timeout_s=600, daemon=False)


def test_grouped_expert_adapters_reshard_between_expert_tp2_and_tp1(results):
    for rank in (0, 1):
        got = results[rank]
        assert got["count"] > 0 and got["same_keys"]
        assert got["fresh_differs"] > 0  # the rebuilt model starts from other adapters
        assert got["differs_after_load"] == [], got["differs_after_load"]
        assert got["differs_back_at_tp2"] == [], got["differs_back_at_tp2"]
    # the case that needs unpadding: each rank's gated FC1 B rows are padded 36 -> 40
    assert any(shape[1] == 40 for shape in results[0]["padded_rows"]), results[0]["padded_rows"]
