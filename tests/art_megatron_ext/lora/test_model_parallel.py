"""LoRA under model parallelism, on 2 gloo ranks against 1 rank (one spawn of each).

- Tensor parallelism: TP=2, with and without sequence parallelism, trains and exports the
  same adapter as TP=1. The A/B shards follow the base layer's split and the gradients are
  reduced as Megatron expects; if either were wrong, the TP=2 adapter after two SGD steps
  would differ from TP=1. For sequence parallelism the test does what Megatron's
  `finalize_model_grads` does for parameters marked `sequence_parallel`: all-reduce their
  gradients over the TP group.
- The Transformer Engine spec (CPU stand-in of Megatron's TE wrappers, layernorm fused into
  QKV and FC1) at TP=2, with and without sequence parallelism, trains and exports the TP=1
  local-spec adapter from the same initial weights.
- Export gathers to the writing rank only: rank 1 receives no tensor during `export_peft`.
- Expert parallelism: each EP rank holds different experts; the export gathers them all
  under their global expert indices and equals the EP=1 export.
- Pipeline parallelism: each stage holds half of the layers; the export gathers every layer
  under its global HF index and equals the single-stage export.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from support.gpt_shapes import SMALL
from support.gpt_shapes import TINY as SHAPE
from support.train_ranks import run_ranks

EXPERTS = 4
STEPS = 2
ATOL = 1e-6  # float32 reduction-order differences; a wrong reduction is off by O(|B|)


def _loss(model, step: int) -> torch.Tensor:
    from art_megatron_ext.lora.cpu_runtime import causal_mask

    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 17), generator=g)
    positions = torch.arange(16).expand(2, 16)
    return model(tokens[:, :-1], positions, causal_mask(16), labels=tokens[:, 1:]).mean()


def _te_spec(sequence_parallel: bool):
    """Megatron's TE GPT layer spec built with the TE stand-in (see support/te_standin.py)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from support.te_standin import te_standin_layer_spec

    from art_megatron_ext.lora.tiny_gpt import SequenceParallelRMSNorm

    spec = te_standin_layer_spec()
    if not sequence_parallel:
        return spec
    return TransformerBlockSubmodules(
        layer_specs=[spec] * SHAPE["num_hidden_layers"], layer_norm=SequenceParallelRMSNorm
    )


def _tensor_elements(obj) -> int:
    if torch.is_tensor(obj):
        return obj.numel()
    if isinstance(obj, dict):
        return sum(_tensor_elements(v) for v in obj.values())
    if isinstance(obj, (list, tuple, set)):
        return sum(_tensor_elements(v) for v in obj)
    return 0


def _elements_received(fn) -> int:
    """Tensor elements that land in this rank's output buffers of torch.distributed's gather
    collectives while `fn` runs (a rank that receives nothing counts 0)."""
    d = torch.distributed
    outputs = {"all_gather": 0, "all_gather_object": 0, "gather": 1, "gather_object": 1}
    names = {"gather": "gather_list", "gather_object": "object_gather_list"}
    saved = {name: getattr(d, name) for name in outputs}
    received = [0]

    def wrap(name, original):
        def collective(*args, **kwargs):
            result = original(*args, **kwargs)
            index = outputs[name]
            out = args[index] if len(args) > index else kwargs.get(names.get(name, ""))
            received[0] += _tensor_elements(out)
            return result

        return collective

    for name, original in saved.items():
        setattr(d, name, wrap(name, original))
    try:
        fn()
    finally:
        for name, original in saved.items():
            setattr(d, name, original)
    return received[0]


def _load_renamed_(model, local_state: dict) -> None:
    """Load a local-spec state dict into the TE-spec model (norms live in the fused linears)."""
    renames = {
        "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
        "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    }
    state = {}
    for key, value in local_state.items():
        for old, new in renames.items():
            if key.endswith(old) and ".layers." in key:
                key = key[: -len(old)] + new
        state[key] = value
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing, missing
    assert all(k.endswith("_extra_state") for k in unexpected), unexpected  # local linears'


def _tp_case(world_size: int, sequence_parallel_runs, out_dir: str) -> dict:
    from megatron.core import parallel_state

    from art_megatron_ext.lora import LoraConfig, attach_lora, zero_lora_padding_
    from art_megatron_ext.lora.cpu_runtime import cpu_megatron
    from art_megatron_ext.lora.export import collect_peft_tensors, export_peft
    from art_megatron_ext.lora.slot_ops import import_peft
    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt

    results, initial = {}, {}
    parallel_state.initialize_model_parallel(world_size, 1)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    runs = [("local", sp) for sp in sequence_parallel_runs]
    if world_size > 1:  # the TE spec (stand-in) at TP=2 against the local spec at TP=1
        runs += [("te", sp) for sp in sequence_parallel_runs]
    try:
        with cpu_megatron():
            for spec, sp in runs:
                torch.manual_seed(0)
                model = build_gpt(
                    GptShape(**SHAPE),
                    tensor_parallel=world_size,
                    sequence_parallel=sp,
                    layer_spec=_te_spec(sp) if spec == "te" else None,
                )
                if spec == "local":
                    initial[sp] = {
                        k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)
                    }
                else:  # the local model's initial weights, under their TE names
                    _load_renamed_(model, initial[sp])
                attach_lora(model, LoraConfig(rank=8, alpha=16.0))
                params = [p for p in model.parameters() if p.requires_grad]
                # SGD keeps float rounding differences linear (Adam's first step is ~lr*sign(g))
                optimizer = torch.optim.SGD(params, lr=1.0)
                losses = []
                for step in range(STEPS):
                    loss = _loss(model, step)
                    loss.backward()
                    for p in params:  # Megatron's finalize_model_grads, for SP-marked params
                        if getattr(p, "sequence_parallel", False):
                            torch.distributed.all_reduce(p.grad, group=tp_group)
                    zero_lora_padding_(model, optimizer)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    losses.append(loss.item())
                tensors, _ = collect_peft_tensors(model, "default", dst=None)
                export_dir = f"{out_dir}/{spec}_sp{int(sp)}"
                received = _elements_received(
                    lambda: export_peft(model, "default", export_dir, "tiny")  # noqa: B023
                )
                torch.distributed.barrier()  # rank 0 has written the directory
                import_peft(model, "copy", export_dir)  # each rank its shards
                copied, _ = collect_peft_tensors(model, "copy", dst=None)
                round_trip = copied.keys() == tensors.keys() and all(
                    torch.equal(copied[k], tensors[k]) for k in tensors
                )
                marked = [p for p in params if getattr(p, "sequence_parallel", False)]
                sharded = _lora_sharding(model) if not sp else {}
                results[sp if spec == "local" else (spec, sp)] = {
                    "received_by_export": received,
                    "losses": losses,
                    "tensors": {k: v.numpy() for k, v in tensors.items()},  # plain pickles
                    "sp_marked": len(marked),
                    "round_trip": round_trip,
                    "sharded": sharded,
                }
    finally:
        parallel_state.destroy_model_parallel()
    return results


def _lora_sharding(model) -> dict:
    """(global shape, offset, replica id) of layer 0's LoRA dist-checkpoint entries."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    entries = model.sharded_state_dict(metadata={"dp_cp_group": group})
    layer = "decoder.layers.0."
    out = {}
    for name in ("self_attention.linear_qkv", "self_attention.linear_proj"):
        for factor in "ab":
            t = entries[f"{layer}{name}.lora.slots.default.{factor}"]
            # drop the leading layer axis the transformer block prepends
            out[f"{name}.{factor}"] = (t.global_shape[1:], t.global_offset[1:], t.replica_id)
    return out


def _seeded_b_(model) -> None:
    """B of every site from a seed and the site's stable name: the same at any parallel size."""
    from art_megatron_ext.lora import iter_lora_sites
    from art_megatron_ext.lora.padding import logical_view
    from art_megatron_ext.lora.site import seeded_generator

    with torch.no_grad():
        for entry in iter_lora_sites(model):
            b = logical_view(entry.adapter.b)
            g = seeded_generator(7, entry.site.info.stable_key)
            b.copy_(torch.randn(b.shape, generator=g))


def _ep_case(world_size: int) -> dict:
    from megatron.core import parallel_state
    from support.megatron_cpu import cpu_shim

    from art_megatron_ext.lora import LoraConfig, attach_lora, iter_lora_sites
    from art_megatron_ext.lora.cpu_runtime import cpu_megatron
    from art_megatron_ext.lora.export import _site_tensors, collect_peft_tensors
    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world_size)
    try:
        with cpu_shim(), cpu_megatron():  # MoE token dispatcher streams, then Megatron RNG
            torch.manual_seed(0)
            model = build_gpt(
                GptShape(**{**SMALL, "num_hidden_layers": 2}),
                num_experts=EXPERTS,
                expert_parallel=world_size,
            )
            attach_lora(model, LoraConfig(rank=4, alpha=8.0))
            _seeded_b_(model)
            local = {}
            for entry in iter_lora_sites(model):
                local.update(_site_tensors(entry.site, entry.adapter, None))
            gathered, _ = collect_peft_tensors(model, "default", dst=None)
    finally:
        parallel_state.destroy_model_parallel()
    as_numpy = lambda d: {k: v.numpy() for k, v in d.items()}  # noqa: E731 (plain pickles)
    return {"local": as_numpy(local), "gathered": as_numpy(gathered)}


def _pp_case(world_size: int) -> dict:
    from megatron.core import parallel_state

    from art_megatron_ext.lora import LoraConfig, attach_lora, iter_lora_sites
    from art_megatron_ext.lora.cpu_runtime import cpu_megatron
    from art_megatron_ext.lora.export import collect_peft_tensors
    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt

    parallel_state.initialize_model_parallel(1, world_size)
    try:
        with cpu_megatron():
            torch.manual_seed(0)
            model = build_gpt(GptShape(**SMALL), pipeline_parallel=world_size)
            attach_lora(model, LoraConfig(rank=4, alpha=8.0))
            layers = sorted({e.site.info.layer_number for e in iter_lora_sites(model)})
            _seeded_b_(model)
            gathered, _ = collect_peft_tensors(model, "default", dst=None)
    finally:
        parallel_state.destroy_model_parallel()
    return {"layers": layers, "gathered": {k: v.numpy() for k, v in gathered.items()}}


def _worker(rank: int, world_size: int, out_dir: str) -> dict:
    return {
        "tp": _tp_case(world_size, [False] if world_size == 1 else [False, True], out_dir),
        "ep": _ep_case(world_size),
        "pp": _pp_case(world_size),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_mp")
    one = run_ranks(_worker, world_size=1, args=(str(root / "one"),))
    two = run_ranks(_worker, world_size=2, args=(str(root / "two"),))
    for per_rank in (*one, *two):
        for result in per_rank["tp"].values():
            result["tensors"] = {k: torch.from_numpy(v) for k, v in result["tensors"].items()}
    return root, one, two


@pytest.fixture(scope="module")
def tp_runs(runs):
    root, one, two = runs
    return root, [r["tp"] for r in one], [r["tp"] for r in two]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp2_adapter_equals_tp1_adapter(tp_runs, sequence_parallel):
    _, tp1, tp2 = tp_runs
    ref = tp1[0][False]
    for rank in (0, 1):
        got = tp2[rank][sequence_parallel]
        assert got["tensors"].keys() == ref["tensors"].keys()
        for key, want in ref["tensors"].items():
            torch.testing.assert_close(got["tensors"][key], want, rtol=0, atol=ATOL)
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    # the adapter did move away from its initialization (B starts at zero)
    assert all(ref["tensors"][k].abs().max() > 1e3 * ATOL for k in ref["tensors"] if "lora_B" in k)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp2_export_is_written_once_with_gathered_tensors(tp_runs, sequence_parallel):
    root, _, tp2 = tp_runs
    export_dir = root / "two" / f"local_sp{int(sequence_parallel)}"
    written = load_file(export_dir / "adapter_model.safetensors")
    collected = tp2[0][sequence_parallel]["tensors"]
    assert written.keys() == collected.keys()
    assert all(torch.equal(written[k], collected[k]) for k in written)
    q_b = written["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert tuple(q_b.shape) == (128, 8)  # both ranks' query groups, unpadded


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_te_spec_tp2_adapter_equals_local_spec_tp1_adapter(tp_runs, sequence_parallel):
    """TE linears (stand-in; layernorm fused into QKV and FC1) follow the same TP rules as
    the local ones: trained at TP=2 from the same weights they export the TP=1 local adapter."""
    root, tp1, tp2 = tp_runs
    ref = tp1[0][False]
    for rank in (0, 1):
        got = tp2[rank][("te", sequence_parallel)]
        assert got["tensors"].keys() == ref["tensors"].keys()
        for key, want in ref["tensors"].items():
            torch.testing.assert_close(got["tensors"][key], want, rtol=0, atol=ATOL)
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert got["round_trip"]
    assert got["sp_marked"] > 0 if sequence_parallel else got["sp_marked"] == 0
    written = load_file(
        root / "two" / f"te_sp{int(sequence_parallel)}" / "adapter_model.safetensors"
    )
    assert written.keys() == ref["tensors"].keys()


def test_export_gathers_the_adapter_to_the_writing_rank_only(tp_runs):
    """export_peft used to all_gather_object the whole adapter (and all-gather every TP
    shard) to every rank; now only rank 0, which writes, receives tensors."""
    _, _, tp2 = tp_runs
    for run in tp2[0]:
        assert tp2[0][run]["received_by_export"] > 0, run
        assert tp2[1][run]["received_by_export"] == 0, run


def test_sequence_parallel_marks_the_replicated_factors(tp_runs):
    _, _, tp2 = tp_runs
    assert tp2[0][True]["sp_marked"] > 0 and tp2[0][False]["sp_marked"] == 0


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp2_import_loads_each_rank_shard_of_the_export(tp_runs, sequence_parallel):
    """PEFT dir -> slot on TP=2 (every rank picks its shard) -> gathered export is identical."""
    _, _, tp2 = tp_runs
    assert tp2[0][sequence_parallel]["round_trip"] and tp2[1][sequence_parallel]["round_trip"]


def test_dist_checkpoint_entries_shard_the_split_factor_like_the_base(tp_runs):
    """Megatron dist-checkpointing sees QKV's B split on rows and proj's A on columns (each
    rank saves its shard), and the replicated factors as replicas of one tensor."""
    _, _, tp2 = tp_runs
    for rank in (0, 1):
        got = tp2[rank][False]["sharded"]
        qkv_b_shape, qkv_b_offset, _ = got["self_attention.linear_qkv.b"]
        assert qkv_b_shape == (256, 16) and qkv_b_offset == (128 * rank, 0)
        proj_a_shape, proj_a_offset, _ = got["self_attention.linear_proj.a"]
        assert proj_a_shape == (16, 128) and proj_a_offset == (0, 64 * rank)
        qkv_a_shape, qkv_a_offset, qkv_a_replica = got["self_attention.linear_qkv.a"]
        assert qkv_a_shape == (16, 128) and qkv_a_offset == (0, 0)
        assert (qkv_a_replica[1] if isinstance(qkv_a_replica, tuple) else qkv_a_replica) == rank


def _experts_in(keys) -> set[int]:
    return {int(k.split(".experts.")[1].split(".")[0]) for k in keys if ".experts." in k}


def test_each_ep_rank_holds_half_of_the_experts(runs):
    _, _, ep2 = runs
    ep2 = [r["ep"] for r in ep2]
    assert _experts_in(ep2[0]["local"]) == {0, 1}
    assert _experts_in(ep2[1]["local"]) == {2, 3}


def test_export_gathers_every_expert_under_its_global_index(runs):
    _, _, ep2 = runs
    ep2 = [r["ep"] for r in ep2]
    for rank in (0, 1):
        gathered = ep2[rank]["gathered"]
        assert _experts_in(gathered) == set(range(EXPERTS))
        for owner in (0, 1):  # each expert's tensors are its owner's, unchanged
            for key, value in ep2[owner]["local"].items():
                assert (gathered[key] == value).all(), key
    # per layer: q, k, v, o + 4 experts x (gate, up, down), each with A and B
    assert len(ep2[0]["gathered"]) == 2 * 2 * (4 + EXPERTS * 3)


def test_ep2_export_equals_ep1_export(runs):
    _, ep1, ep2 = runs
    ep1, ep2 = [r["ep"] for r in ep1], [r["ep"] for r in ep2]
    want, got = ep1[0]["gathered"], ep2[0]["gathered"]
    assert want.keys() == got.keys()
    assert all((got[k] == want[k]).all() for k in want)


def test_each_stage_holds_its_layers(runs):
    _, _, pp2 = runs
    pp2 = [r["pp"] for r in pp2]
    assert pp2[0]["layers"] == [1, 2] and pp2[1]["layers"] == [3, 4]


def test_pp2_export_has_every_layer_and_equals_pp1_export(runs):
    _, pp1, pp2 = runs
    pp1, pp2 = [r["pp"] for r in pp1], [r["pp"] for r in pp2]
    want = pp1[0]["gathered"]
    layers = {int(k.split(".layers.")[1].split(".")[0]) for k in want}
    assert layers == {0, 1, 2, 3} and len(want) == 4 * 7 * 2
    for rank in (0, 1):
        got = pp2[rank]["gathered"]
        assert got.keys() == want.keys()
        assert all((got[k] == want[k]).all() for k in want)
