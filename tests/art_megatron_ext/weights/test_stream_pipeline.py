"""A model split into pipeline stages streams whole from the first stage's sender.

Before, `stream_hf_weights` refused `pipeline_model_parallel_size > 1`. Now each stage makes its
own tensors whole (its TP/EP gathers) and, in the sender's pipeline group, sends them to the
sender on the first stage (`weights.stage_relay`). Checked with zoo checkpoints loaded into
stage-split models (the loaders map global layer names onto each stage's layers): at PP=2
(and PP=2 x TP=2, Qwen3) global rank 0 hands the sink exactly the checkpoint's tensors
(Llama-3.2 tied: no `lm_head.weight`, though its last stage holds a copy of the embedding
as its output layer; Qwen3 untied; DeepSeek-V3 with its MoE layer on the second stage), every
other rank sends
nothing and counts its own stage's tensors; a sender on a later stage is refused on every rank
before anything moves.
"""

from __future__ import annotations

import pytest
import torch
from support.model_zoo import checkpoint
from support.train_ranks import run_ranks
from support.weight_stream import collect_stream

pytestmark = pytest.mark.train

DIVISIBLE = 128
MODELS = ("llama3.2", "qwen3", "deepseek-v3")


def _build(name: str, hf_dir: str):
    torch.manual_seed(0)
    if name == "deepseek-v3":
        from art_megatron_ext.lora.deepseek_gpt import build_deepseek_gpt
        from art_megatron_ext.lora.hf_deepseek import DeepseekShape
        from art_megatron_ext.lora.hf_deepseek_weights import load_hf_deepseek_weights

        shape = DeepseekShape.from_hf_config(hf_dir)
        model = build_deepseek_gpt(shape, make_vocab_size_divisible_by=DIVISIBLE)
        load_hf_deepseek_weights(model, hf_dir, shape)
        return model, shape
    from megatron.core import parallel_state as ps

    from art_megatron_ext.lora.hf_weights import load_hf_weights
    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt

    shape = GptShape.from_hf_config(hf_dir)
    model = build_gpt(
        shape,
        tensor_parallel=ps.get_tensor_model_parallel_world_size(),
        pipeline_parallel=ps.get_pipeline_model_parallel_world_size(),
        make_vocab_size_divisible_by=DIVISIBLE,
    )
    load_hf_weights(model, hf_dir, shape)
    return model, shape


def _worker(rank: int, world: int, dirs: dict[str, str], tp: int, names: tuple) -> dict:
    from support.megatron_cpu import cpu_shim, megatron_parallel

    from art_megatron_ext.lora.cpu_runtime import cpu_megatron

    out = {}
    with cpu_shim(), cpu_megatron(), megatron_parallel(tp=tp, pp=world // tp):
        for name in names:
            model, shape = _build(name, dirs[name])
            out[name] = collect_stream(model, shape)
        model, shape = _build("qwen3", dirs["qwen3"])
        try:  # a sender on the last stage
            collect_stream(model, shape, send=rank == world - 1)
            out["later_sender"] = None
        except ValueError as exc:
            out["later_sender"] = str(exc)
    return out


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("zoo_pp")
    return {name: str(checkpoint(name, root)) for name in MODELS}


#: layout -> (world, TP, models). At PP=2 x TP=2 (four ranks on two cores) the small dense Qwen3
#: alone: two pipeline groups, of which only the sender's relays (the other's first stage is
#: TP rank 1 and sends nothing), each stage's TP gathers before the relay.
LAYOUTS = {"pp2": (2, 1, MODELS), "pp2xtp2": (4, 2, ("qwen3",))}
CASES = [(layout, name) for layout, (_, _, names) in LAYOUTS.items() for name in names]


@pytest.fixture(scope="module")
def runs(zoo):
    """layout -> every rank's results, each layout run once when first asked for."""
    cache: dict[str, list] = {}

    def get(layout: str) -> list:
        if layout not in cache:
            world, tp, names = LAYOUTS[layout]
            cache[layout] = run_ranks(_worker, world_size=world, args=(zoo, tp, names))
        return cache[layout]

    return get


@pytest.mark.parametrize(("layout", "name"), CASES)
def test_the_first_stage_sends_the_whole_checkpoint(runs, zoo, layout, name):
    from safetensors.torch import load_file

    ranks = runs(layout)
    want = load_file(f"{zoo[name]}/model.safetensors")
    sent = {n: torch.from_numpy(a) for n, a in ranks[0][name][0]}
    assert sorted(sent) == sorted(want)  # every stage's layers; tied: no lm_head.weight
    for key, tensor in want.items():
        assert torch.equal(sent[key], tensor.float()), key
    receipt = ranks[0][name][1]
    assert receipt.tensors == len(want) and receipt.digest is not None
    for other in ranks[1:]:
        assert other[name][0] == [] and other[name][1].digest is None
        assert 0 < other[name][1].tensors < len(want)  # its own stage's tensors


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_sender_on_a_later_stage_is_refused_on_every_rank(runs, layout):
    for rank in runs(layout):
        assert "must be on the first stage" in rank["later_sender"]
