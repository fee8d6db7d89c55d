"""The model zoo through the trainer side: HF -> Megatron -> one training step -> HF names.

For each zoo checkpoint (`support.model_zoo`: Llama-3.1 rope llama3, Llama-3.2 tied, Qwen2.5
q/k/v biases + tied, Qwen3 q/k norms with head_dim != hidden / heads, Qwen3-MoE), at TP=1 and
TP=2 (gloo ranks, Megatron's parallel state, vocabulary padded as Megatron trainers pad it;
Qwen3-MoE unpadded, sequence parallel at TP=2, experts sharded over expert tensor parallel 2
and, separately, whole on each rank at ETP=1):
- the Megatron model's logits equal Hugging Face transformers' fp32 logits of the checkpoint
  (LOGITS_ATOL; the padded columns are not part of the model's answer);
- its stream gives back exactly the checkpoint's tensors (names, shapes, values: no padded
  row, no `lm_head.weight` where the checkpoint ties it);
- after one training step the stream is bitwise what the model holds (the loader maps the
  streamed tensors back onto every rank's parameters exactly) and the padded rows are still 0.
DeepSeek-V3 (multi-latent attention, yarn rope, shared expert, grouped sigmoid routing with
an expert bias, a dense first layer; `lora.hf_deepseek`) runs the same checks at TP=1 and TP=2
with the vocabulary padded, its routers' expert bias streamed as `e_score_correction_bias`.

Observed here: logits vs HF within about 2e-6 (fp32 on both sides).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.model_zoo import DENSE, ZOO_VOCAB, checkpoint
from support.train_ranks import run_ranks
from support.weight_stream import collect_stream

pytestmark = pytest.mark.train

DIVISIBLE = 128  # Megatron's default make_vocab_size_divisible_by
LOGITS_ATOL = 1e-4
PROMPT_LEN = 48  # past the llama3 band's 16..64-token wavelengths


def _prompts() -> torch.Tensor:
    return torch.randint(3, ZOO_VOCAB, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(5))


def _full_logits(local: torch.Tensor, world: int, vocab: int) -> torch.Tensor:
    """[b, s, vocab] from this TP rank's [b, s, V/tp] shard (padded columns dropped)."""
    from megatron.core import parallel_state

    parts = [torch.empty_like(local) for _ in range(world)]
    torch.distributed.all_gather(
        parts, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group()
    )
    return torch.cat(parts, dim=-1)[..., :vocab]


def _forward(model, tokens: torch.Tensor) -> torch.Tensor:
    from art_megatron_ext.lora.cpu_runtime import causal_mask

    positions = torch.arange(tokens.shape[1])[None].expand_as(tokens)
    return model(tokens, positions, causal_mask(tokens.shape[1]))


def _step(model, rank: int, world: int) -> None:
    """One SGD step on a fixed linear function of the logits (zero on padded columns)."""
    logits = _forward(model, _prompts())
    g = torch.Generator().manual_seed(9)
    weights = torch.randn(*logits.shape[:2], logits.shape[-1] * world, generator=g)
    weights[..., ZOO_VOCAB:] = 0
    loss = (logits * weights.chunk(world, dim=-1)[rank]).sum() / logits.numel()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad


def _padded_rows_zero(params: dict, rank: int, world: int) -> bool:
    """Every padded vocabulary row this rank holds is exactly zero."""
    ok = True
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name not in params:
            continue
        local = params[name]
        start = rank * local.shape[0]
        first_pad = max(0, ZOO_VOCAB - start)
        ok &= bool((local[first_pad:] == 0).all())
    return ok


def _dense(name: str, hf_dir: str, rank: int, world: int) -> dict:
    from art_megatron_ext.lora.hf_weights import load_hf_weights, megatron_state_from_hf
    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt

    shape = GptShape.from_hf_config(hf_dir)
    torch.manual_seed(0)
    model = build_gpt(shape, tensor_parallel=world, make_vocab_size_divisible_by=DIVISIBLE)
    load_hf_weights(model, hf_dir, shape)
    params = dict(model.named_parameters())
    padded = params["embedding.word_embeddings.weight"].shape[0] * world
    out = {"loaded": collect_stream(model, shape), "padded_vocab": padded}
    with torch.no_grad():
        out["logits"] = _full_logits(_forward(model, _prompts()), world, ZOO_VOCAB).numpy()
    _step(model, rank, world)
    out["padded_rows_zero"] = _padded_rows_zero(params, rank, world)
    sent, _ = collect_stream(model, shape, send=True)
    tensors = {n: torch.from_numpy(a) for n, a in sent}
    back = megatron_state_from_hf(tensors, shape, rank, world, padded_vocab=padded)
    out["after_step"] = (sorted(tensors), {n: tuple(t.shape) for n, t in tensors.items()})
    out["not_bitwise"] = sorted(n for n, t in back.items() if not torch.equal(t, params[n]))
    out["unmapped_params"] = sorted(set(params) - set(back))
    return out


def _moe(hf_dir: str, world: int) -> dict:
    """Qwen3-MoE at this TP (sequence parallel on at TP > 1, as Megatron requires), experts
    sharded over expert tensor parallel (ETP = TP, Megatron's default)."""
    from art_megatron_ext.lora.hf_moe_weights import MoeShape, build_moe_gpt, load_hf_moe_weights

    shape = MoeShape.from_hf_config(hf_dir)
    torch.manual_seed(0)
    model = build_moe_gpt(shape)
    load_hf_moe_weights(model, hf_dir, shape)
    with torch.no_grad():
        logits = _full_logits(_forward(model, _prompts()), world, ZOO_VOCAB)
    return {"loaded": collect_stream(model, shape), "logits": logits.numpy()}


def _deepseek(hf_dir: str, rank: int, world: int) -> dict:
    """DeepSeek-V3 at this TP (sequence parallel at TP > 1), vocabulary padded, routed experts
    over expert TP = TP: logits, stream, one step, stream again and map it back."""
    from megatron.core import parallel_state as ps

    from art_megatron_ext.lora.deepseek_gpt import build_deepseek_gpt
    from art_megatron_ext.lora.hf_deepseek import DeepseekShape
    from art_megatron_ext.lora.hf_deepseek_weights import (
        load_hf_deepseek_weights,
        megatron_deepseek_state_from_hf,
    )
    from art_megatron_ext.lora.hf_moe_weights import moe_targets

    shape = DeepseekShape.from_hf_config(hf_dir)
    torch.manual_seed(0)
    model = build_deepseek_gpt(shape, make_vocab_size_divisible_by=DIVISIBLE)
    load_hf_deepseek_weights(model, hf_dir, shape)
    params = moe_targets(model)
    padded = params["embedding.word_embeddings.weight"].shape[0] * world
    out = {"loaded": collect_stream(model, shape), "padded_vocab": padded}
    with torch.no_grad():
        out["logits"] = _full_logits(_forward(model, _prompts()), world, ZOO_VOCAB).numpy()
    _step(model, rank, world)
    out["padded_rows_zero"] = _padded_rows_zero(params, rank, world)
    sent, _ = collect_stream(model, shape, send=True)
    tensors = {n: torch.from_numpy(a) for n, a in sent}
    etp = (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())
    back = megatron_deepseek_state_from_hf(tensors, shape, rank, world, *etp, padded_vocab=padded)
    out["after_step"] = (sorted(tensors), {n: tuple(t.shape) for n, t in tensors.items()})
    out["not_bitwise"] = sorted(n for n, t in back.items() if not torch.equal(t, params[n]))
    out["unmapped_params"] = sorted(set(params) - set(back))
    return out


def _deepseek_grouped(hf_dir: str, world: int) -> dict:
    """DeepSeek-V3 with its routed experts as one `ArtGroupedMLP` per layer (whole on every
    rank: expert TP 1): logits and stream."""
    from art_megatron_ext.lora.deepseek_gpt import build_deepseek_gpt
    from art_megatron_ext.lora.hf_deepseek import DeepseekShape
    from art_megatron_ext.lora.hf_deepseek_weights import load_hf_deepseek_weights

    shape = DeepseekShape.from_hf_config(hf_dir)
    torch.manual_seed(0)
    model = build_deepseek_gpt(shape, make_vocab_size_divisible_by=DIVISIBLE, grouped_experts=True)
    assert any(n.endswith("mlp.experts.linear_fc1.weight") for n, _ in model.named_parameters())
    load_hf_deepseek_weights(model, hf_dir, shape)
    with torch.no_grad():
        logits = _full_logits(_forward(model, _prompts()), world, ZOO_VOCAB)
    return {"loaded": collect_stream(model, shape), "logits": logits.numpy()}


def _worker(rank: int, world: int, dirs: dict[str, str]) -> dict:
    from support.megatron_cpu import cpu_shim, megatron_parallel

    from art_megatron_ext.lora.cpu_runtime import cpu_megatron

    out = {}
    with cpu_shim(), cpu_megatron():
        for name in DENSE:
            with megatron_parallel(tp=world):
                out[name] = _dense(name, dirs[name], rank, world)
        with megatron_parallel(tp=world):
            out["qwen3-moe"] = _moe(dirs["qwen3-moe"], world)
        if world > 1:  # experts whole on every TP rank (expert data parallel over TP)
            with megatron_parallel(tp=world, etp=1):
                out["qwen3-moe-etp1"] = _moe(dirs["qwen3-moe"], world)
        with megatron_parallel(tp=world):
            out["deepseek-v3"] = _deepseek(dirs["deepseek-v3"], rank, world)
        with megatron_parallel(tp=world, etp=1):  # grouped experts stream at expert TP 1
            out["deepseek-v3-grouped"] = _deepseek_grouped(dirs["deepseek-v3"], world)
    return out


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("zoo")
    return {name: str(checkpoint(name, root)) for name in (*DENSE, "qwen3-moe", "deepseek-v3")}


@pytest.fixture(scope="module")
def hf_logits(zoo) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    out = {}
    for name in (*DENSE, "qwen3-moe", "deepseek-v3"):
        model = AutoModelForCausalLM.from_pretrained(zoo[name], dtype=torch.float32).eval()
        with torch.no_grad():
            out[name] = model(_prompts()).logits
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def ranks(request, zoo) -> tuple[int, list[dict]]:
    return request.param, run_ranks(_worker, world_size=request.param, args=(zoo,))


@pytest.mark.parametrize("name", [*DENSE, "qwen3-moe", "deepseek-v3"])
def test_megatron_logits_equal_hf_logits(ranks, hf_logits, name):
    _, results = ranks
    for key in (name, f"{name}-etp1", f"{name}-grouped"):
        if key in results[0]:
            got = torch.from_numpy(results[0][key]["logits"])
            torch.testing.assert_close(got, hf_logits[name], rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("name", [*DENSE, "qwen3-moe", "deepseek-v3"])
def test_stream_gives_back_the_checkpoint(ranks, zoo, name):
    from safetensors.torch import load_file

    _, results = ranks
    want = load_file(f"{zoo[name]}/model.safetensors")
    for case in (name, f"{name}-etp1", f"{name}-grouped"):
        if case not in results[0]:
            continue
        sent = {n: torch.from_numpy(a) for n, a in results[0][case]["loaded"][0]}
        assert sorted(sent) == sorted(want)  # tied: no lm_head.weight; biases, norms present
        for key, tensor in want.items():
            assert sent[key].shape == tensor.shape, key  # the padded vocabulary is trimmed
            assert torch.equal(sent[key], tensor.float()), key
        for other in results[1:]:  # only global rank 0 sends; the receipt is everyone's
            assert other[case]["loaded"][0] == []
            assert other[case]["loaded"][1] == dataclasses.replace(
                results[0][case]["loaded"][1], digest=None
            )


@pytest.mark.parametrize("name", [*DENSE, "deepseek-v3"])
def test_after_a_step_the_stream_is_bitwise_what_the_model_holds(ranks, zoo, name):
    from safetensors.torch import load_file

    _, results = ranks
    want = load_file(f"{zoo[name]}/model.safetensors")
    names, shapes = results[0][name]["after_step"]
    assert names == sorted(want)
    assert shapes == {n: tuple(t.shape) for n, t in want.items()}
    assert results[0][name]["padded_vocab"] > ZOO_VOCAB  # the padding was there to trim
    for rank in results:
        assert rank[name]["padded_rows_zero"]
        assert rank[name]["not_bitwise"] == []
        assert rank[name]["unmapped_params"] == []


def test_the_dense_and_qwen_moe_readers_refuse_deepseek_v3_by_name(zoo):
    from art_megatron_ext.lora.hf_config import UnmappedConfig
    from art_megatron_ext.lora.hf_moe_weights import MoeShape
    from art_megatron_ext.lora.tiny_gpt import GptShape

    for reader in (GptShape, MoeShape):
        with pytest.raises(UnmappedConfig, match="deepseek_v3"):
            reader.from_hf_config(zoo["deepseek-v3"])
