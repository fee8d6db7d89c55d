"""`model.sharded_state_dict()` carries the LoRA adapters of every site kind through Megatron's
`dist_checkpointing`, on 2 gloo ranks (one spawn for every case).

Each case saves a model with non-zero adapters at one parallel layout, then builds the model
again at another layout (or the same one), loads the checkpoint into it and compares the
gathered PEFT export, which is layout independent, with the one taken before saving:
- local spec (Megatron's `ColumnParallelLinear`/`RowParallelLinear`), saved at TP=2, loaded
  at TP=2 and at TP=1 (DP=2): the split factors, the gated FC1's [gate; up] B rows;
- TE spec (the stand-in of `support/te_standin.py`: layernorm-fused QKV/FC1, TE row linears),
  saved at TP=2, loaded at TP=1;
- grouped experts (`TEGroupedMLP` with TE grouped linears, stand-in), saved at EP=2, loaded
  at EP=1: the expert axis of the `[E, ...]` tensors. On today's main the grouped site's
  `sharded_state_dict` raised, so `model.sharded_state_dict()` failed for such a model.
"""

from __future__ import annotations

import pytest
import torch
from support.train_ranks import run_ranks

SHAPE = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=64,
)
EXPERTS = 4
CASES = {  # name: (spec, save layout, load layout); layouts are (tp, ep)
    "local_tp2_to_tp2": ("local", (2, 1), (2, 1)),
    "local_tp2_to_tp1": ("local", (2, 1), (1, 1)),
    "te_tp2_to_tp1": ("te", (2, 1), (1, 1)),
    "grouped_ep2_to_ep1": ("grouped", (1, 2), (1, 1)),
}


def _build(spec: str, tp: int, ep: int):
    from megatron.core import parallel_state
    from support.te_standin import te_standin_layer_spec

    from art_megatron_ext.lora import LoraConfig, attach_lora
    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt

    parallel_state.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
    torch.manual_seed(0)
    shape = GptShape(**SHAPE)
    if spec == "grouped":
        layer_spec = te_standin_layer_spec(num_experts=EXPERTS, moe_grouped_gemm=True)
        model = build_gpt(
            shape,
            num_experts=EXPERTS,
            expert_parallel=ep,
            moe_grouped_gemm=True,
            layer_spec=layer_spec,
        )
    else:
        layer_spec = te_standin_layer_spec() if spec == "te" else None
        model = build_gpt(shape, tensor_parallel=tp, layer_spec=layer_spec)
    attach_lora(model, LoraConfig(rank=4, alpha=8.0))
    return model


def _fill_b_(model, seed: int) -> None:
    from art_megatron_ext.lora import iter_lora_sites
    from art_megatron_ext.lora.padding import logical_view
    from art_megatron_ext.lora.site import seeded_generator

    with torch.no_grad():
        for entry in iter_lora_sites(model):
            b = logical_view(entry.adapter.b)
            g = seeded_generator(seed, entry.site.info.stable_key, entry.site.info.tp_rank)
            b.copy_(torch.randn(b.shape, generator=g))


def _sharded(model):
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return model.sharded_state_dict(metadata={"dp_cp_group": group})


def _case(rank: int, name: str, root: str) -> dict:
    from megatron.core import dist_checkpointing, parallel_state

    from art_megatron_ext.lora.export import collect_peft_tensors

    spec, (tp, ep), (load_tp, load_ep) = CASES[name]
    ckpt = f"{root}/{name}"
    try:
        model = _build(spec, tp, ep)
        _fill_b_(model, seed=3)
        before, _ = collect_peft_tensors(model, "default", dst=None)
        entries = _sharded(model)
        lora_keys = sorted(k for k in entries if ".lora." in k)
        if rank == 0:
            import os

            os.makedirs(ckpt)
        torch.distributed.barrier()
        dist_checkpointing.save(entries, ckpt)
    finally:
        parallel_state.destroy_model_parallel()
    try:
        model = _build(spec, load_tp, load_ep)
        fresh, _ = collect_peft_tensors(model, "default", dst=None)
        loaded = dist_checkpointing.load(_sharded(model), ckpt)
        missing, unexpected = model.load_state_dict(loaded, strict=False)
        after, _ = collect_peft_tensors(model, "default", dst=None)
    finally:
        parallel_state.destroy_model_parallel()
    differs = lambda a, b: sorted(k for k in a if not torch.equal(a[k], b[k]))  # noqa: E731
    return {
        "lora_keys": lora_keys,
        "missing_lora": [k for k in missing if ".lora." in k],
        "unexpected": list(unexpected),
        "same_keys": before.keys() == after.keys(),
        "differs_after_load": differs(before, after) if before.keys() == after.keys() else None,
        "fresh_differs": len(differs(before, fresh)) if before.keys() == fresh.keys() else -1,
        "count": len(before),
    }


def _worker(rank: int, world_size: int, root: str) -> dict:
    from support.megatron_cpu import cpu_shim

    from art_megatron_ext.lora.cpu_runtime import cpu_megatron

    out = {}
    with cpu_shim(), cpu_megatron():  # grouped experts: dispatcher streams on CPU
        for name in CASES:
            out[name] = _case(rank, name, root)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_dist_ckpt")
    return run_ranks(_worker, world_size=2, args=(str(root),), timeout_s=600, daemon=False)


@pytest.mark.parametrize("case", list(CASES))
def test_adapters_survive_a_dist_checkpoint_round_trip(results, case):
    for rank in (0, 1):
        got = results[rank][case]
        assert got["count"] > 0 and got["same_keys"]
        assert got["fresh_differs"] > 0  # the rebuilt model starts from other adapters
        assert got["differs_after_load"] == [], got["differs_after_load"]
        assert got["missing_lora"] == [] and got["unexpected"] == []


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_state_dict_holds_every_slot_factor(results, case):
    keys = results[0][case]["lora_keys"]
    targets = {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"}
    for target in targets:
        assert any(f"{target}.lora.slots.default.a" in k for k in keys), (target, keys)
        assert any(f"{target}.lora.slots.default.b" in k for k in keys), (target, keys)
    if CASES[case][0] == "grouped":
        assert any(".experts.linear_fc1.lora." in k for k in keys)
