"""A Qwen3-MoE Megatron GPT's full weights streamed in HF names, one layer at a time, at EP=1
and EP=2 (gloo ranks, Megatron's own parallel state; MoE at TP=2 is in test_model_zoo.py).

Both directions bit for bit, as for the dense GPT (test_hf_stream.py): HF checkpoint ->
`load_hf_moe_weights` -> stream gives back the checkpoint's tensors (router, every expert of
every EP rank, q/k norms), and random Megatron weights -> stream -> `megatron_moe_state_from_hf`
gives back this rank's parameters (its own experts included), so the stream is the loader's
exact inverse. The same holds with the experts of each layer in one `ArtGroupedMLP`
(`build_moe_gpt(grouped_experts=True)`: [L, in, out] tensors, transposed and split into HF's
per-expert gate/up/down). An unmapped expert parameter is refused by name.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from support.train_ranks import run_ranks
from support.weight_stream import collect_stream, randomize_

from art_protocol.weights_digest import WeightsDigest

pytestmark = pytest.mark.train
TINY_FFN = 256  # support.gpt_shapes.TINY intermediate_size: each expert's FFN width


def _worker(rank: int, world: int, hf_dir: str) -> dict:
    from support.megatron_cpu import cpu_shim, megatron_parallel

    from art_megatron_ext.lora.hf_moe_weights import (
        GROUPED_NAMES,
        MoeShape,
        _global_name,
        build_moe_gpt,
        grouped_expert_state,
        load_hf_moe_weights,
        megatron_moe_state_from_hf,
    )
    from art_megatron_ext.weights import stream_hf_weights

    shape = MoeShape.from_hf_config(hf_dir)
    out = {}
    with cpu_shim(), megatron_parallel(ep=world):
        torch.manual_seed(0)
        model = build_moe_gpt(shape, expert_model_parallel_size=world)
        load_hf_moe_weights(model, hf_dir, shape)
        out["loaded"] = collect_stream(model, shape)
        # random Megatron weights (each EP rank's experts differ) -> stream (every rank
        # sends) -> back to this rank's parameters, in the loader's global names
        randomize_(model, rank)
        mine: dict[str, torch.Tensor] = {}
        stream_hf_weights(model, shape, lambda n, t: mine.__setitem__(n, t.clone()), send=True)
        back = megatron_moe_state_from_hf(mine, shape)
        offset = rank * (shape.num_experts // world)
        params = {_global_name(model, n, offset): p for n, p in model.named_parameters()}
        out["inverse"] = sorted(n for n, p in params.items() if not torch.equal(back[n], p))
        out["inverse_count"] = len(params)
        # the streamed experts of the other EP ranks are theirs, not copies of ours
        out["all_experts"] = sorted(n for n in back if ".local_experts." in n)
        # the same with ArtGroupedMLP experts
        torch.manual_seed(0)
        grouped = build_moe_gpt(shape, expert_model_parallel_size=world, grouped_experts=True)
        assert any(n.endswith(GROUPED_NAMES) for n, _ in grouped.named_parameters())
        load_hf_moe_weights(grouped, hf_dir, shape)
        out["grouped_loaded"] = collect_stream(grouped, shape)
        randomize_(grouped, rank)
        mine = {}
        stream_hf_weights(grouped, shape, lambda n, t: mine.__setitem__(n, t.clone()), send=True)
        local = shape.num_experts // world
        back = {
            n: t[offset : offset + local] if n.endswith(GROUPED_NAMES) else t
            for n, t in grouped_expert_state(megatron_moe_state_from_hf(mine, shape), shape).items()
        }
        params = {_global_name(grouped, n, offset): p for n, p in grouped.named_parameters()}
        out["grouped_inverse"] = sorted(n for n, p in params.items() if not torch.equal(back[n], p))
    return out


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    from support.hf_tiny_moe import random_qwen3_moe_checkpoint

    path = tmp_path_factory.mktemp("hf_moe")
    random_qwen3_moe_checkpoint(path)
    return path


@pytest.fixture(scope="module", params=[1, 2], ids=["ep1", "ep2"])
def streamed(request, hf_checkpoint):
    return request.param, run_ranks(_worker, world_size=request.param, args=(str(hf_checkpoint),))


def test_stream_gives_back_the_moe_checkpoint(hf_checkpoint, streamed):
    from safetensors.torch import load_file

    ep, results = streamed
    assert len(results) == ep
    want = load_file(str(hf_checkpoint / "model.safetensors"))
    sent, receipt = results[0]["loaded"]
    sent = [(name, torch.from_numpy(array)) for name, array in sent]
    assert sorted(n for n, _ in sent) == sorted(want)
    assert len({n for n, _ in sent}) == len(sent)
    for name, tensor in sent:
        assert tensor.dtype == want[name].dtype and torch.equal(tensor, want[name]), name
    # EP rank 1 took part in every expert gather but sent nothing (default: EP rank 0 sends)
    for other in results[1:]:  # and never hashed: the digest is the sender's alone
        assert other["loaded"][0] == [] and other["loaded"][1].digest is None
        assert other["loaded"][1] == dataclasses.replace(receipt, digest=None)
    # one layer at a time: layer indices never go back; experts in global order per layer
    names = [n for n, _ in sent]
    layers = [int(m.group(1)) for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n))]
    assert layers == sorted(layers) and len(set(layers)) == 3
    experts = [
        int(m.group(1)) for n in names if (m := re.search(r"\.layers\.2\.mlp\.experts\.(\d+)\.", n))
    ]
    assert experts == sorted(experts) == [e for e in range(4) for _ in range(3)]
    digest = WeightsDigest()
    for name, tensor in sent:
        digest.update(
            name, str(tensor.dtype), tuple(tensor.shape), tensor.view(torch.uint8).numpy()
        )
    assert receipt.digest == digest.hexdigest() and receipt.tensors == len(sent)
    assert receipt.bytes == sum(t.numel() * t.element_size() for _, t in sent)


def test_grouped_experts_stream_the_same_checkpoint(streamed):
    _, results = streamed
    for r in results:
        assert r["grouped_loaded"][1] == r["loaded"][1]  # same digest: same names and bytes
    assert [n for n, _ in results[0]["grouped_loaded"][0]] == [
        n for n, _ in results[0]["loaded"][0]
    ]
    for r in results:
        assert r["grouped_inverse"] == []


def test_stream_inverts_the_moe_loader_on_every_ep_rank(streamed):
    ep, results = streamed
    assert len(results) == ep
    for r in results:
        assert r["inverse"] == [] and r["inverse_count"] > 0
        # every rank got all 4 experts of both MoE layers (2 tensors each), not only its own
        assert len(r["all_experts"]) == 2 * 4 * 2


def _refusal_worker(rank: int, world: int) -> str:
    from support.gpt_shapes import TINY
    from support.megatron_cpu import cpu_shim, megatron_parallel

    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt
    from art_megatron_ext.weights import stream_hf_weights

    shape = GptShape(**TINY)
    with cpu_shim(), megatron_parallel():
        model = build_gpt(shape, num_experts=4)
        # a legacy grouped-experts parameter name (GroupedMLP's weight1 / weight2 style)
        model.decoder.layers[0].mlp.experts.register_parameter(
            "weight0", torch.nn.Parameter(torch.zeros(1))
        )
        try:
            stream_hf_weights(model, shape, lambda n, t: None)
        except NotImplementedError as exc:
            return str(exc)
    return "no refusal"


def test_an_unmapped_expert_parameter_is_refused_by_name():
    (result,) = run_ranks(_refusal_worker, world_size=1)
    assert "decoder.layers.0.mlp.experts.weight0" in result and "SequentialMLP" in result


def _te_grouped_worker(rank: int, world: int) -> dict:
    from support.gpt_shapes import TINY
    from support.megatron_cpu import cpu_shim, megatron_parallel
    from support.te_standin import te_standin_layer_spec

    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt

    shape = GptShape(**TINY)
    with cpu_shim(), megatron_parallel():
        torch.manual_seed(0)
        model = build_gpt(
            shape,
            num_experts=4,
            moe_grouped_gemm=True,
            layer_spec=te_standin_layer_spec(num_experts=4, moe_grouped_gemm=True),
        )
        randomize_(model, rank)
        sent, _ = collect_stream(model, shape)
        params = {n: p.detach().numpy() for n, p in model.named_parameters()}
    return {"sent": dict(sent), "params": params}


def test_te_grouped_experts_stream_each_expert_in_hf_names():
    """`TEGroupedMLP` holds expert j's fc1 as `linear_fc1.weight{j}` [2 * ffn, hidden]
    ([gate; up]) and fc2 as `linear_fc2.weight{j}`: each is sent as HF's three projections."""
    (result,) = run_ranks(_te_grouped_worker, world_size=1)
    sent, params = result["sent"], result["params"]
    ffn = TINY_FFN
    for layer in range(2):
        m = f"decoder.layers.{layer}.mlp.experts."
        for e in range(4):
            h = f"model.layers.{layer}.mlp.experts.{e}."
            fc1 = params[f"{m}linear_fc1.weight{e}"]
            assert (sent[h + "gate_proj.weight"] == fc1[:ffn]).all()
            assert (sent[h + "up_proj.weight"] == fc1[ffn:]).all()
            assert (sent[h + "down_proj.weight"] == params[f"{m}linear_fc2.weight{e}"]).all()
        norm = f"model.layers.{layer}.post_attention_layernorm.weight"
        assert (sent[norm] == params[f"decoder.layers.{layer}.pre_mlp_layernorm.weight"]).all()
