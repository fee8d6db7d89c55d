"""A Megatron GPT's full weights streamed in the served model's (HF) names, one layer at a
time, at TP=1 and TP=2 (gloo ranks, Megatron's own parallel state).

Both directions are checked bit for bit: HF checkpoint -> Megatron (`load_hf_weights`) ->
stream gives back the checkpoint's tensors, and random Megatron weights -> stream ->
`megatron_state_from_hf` gives back the Megatron shards, so the stream is the exact inverse of
the loader whatever the checkpoint. The receipt's digest is the digest of what the sink got.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from support.gpt_shapes import TINY
from support.train_ranks import run_ranks
from support.weight_stream import collect_stream, randomize_

from art_protocol.weights_digest import WeightsDigest, digest_checkpoint


def _worker(rank: int, world: int, hf_dir: str) -> dict:
    from support.megatron_cpu import cpu_shim, megatron_parallel

    from art_megatron_ext.lora.hf_weights import load_hf_weights, megatron_state_from_hf
    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt
    from art_megatron_ext.weights import stream_hf_weights

    shape = GptShape(**TINY)
    out = {}
    with cpu_shim(), megatron_parallel(tp=world):
        torch.manual_seed(0)
        model = build_gpt(shape, tensor_parallel=world)
        load_hf_weights(model, hf_dir, shape)
        out["loaded"] = collect_stream(model, shape)
        # random Megatron weights -> stream (every rank sends) -> back to this rank's shards
        randomize_(model, rank)
        mine: dict[str, torch.Tensor] = {}
        stream_hf_weights(model, shape, lambda n, t: mine.__setitem__(n, t.clone()), send=True)
        back = megatron_state_from_hf(mine, shape, rank, world)
        params = dict(model.named_parameters())
        out["inverse"] = sorted(n for n, t in back.items() if not torch.equal(t, params[n]))
        out["inverse_count"] = len(back)
    return out


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    from support.hf_tiny import random_llama_checkpoint

    from art_megatron_ext.lora.tiny_gpt import GptShape

    return random_llama_checkpoint(GptShape(**TINY), tmp_path_factory.mktemp("hf"))


@pytest.mark.parametrize("tp", [1, 2])
def test_stream_gives_back_the_checkpoint_and_inverts_the_loader(hf_checkpoint, tp):
    from safetensors.torch import load_file

    results = run_ranks(_worker, world_size=tp, args=(str(hf_checkpoint),))
    want = load_file(str(hf_checkpoint / "model.safetensors"))
    sent, receipt = results[0]["loaded"]
    sent = [(name, torch.from_numpy(array)) for name, array in sent]
    assert [n for n, _ in sent if n in want] == [n for n, _ in sent]
    assert sorted(n for n, _ in sent) == sorted(want)
    for name, tensor in sent:
        assert tensor.dtype == want[name].dtype and torch.equal(tensor, want[name]), name
    # TP rank 1 took part in every gather but sent nothing (default: TP rank 0 sends), and
    # never hashed: the digest is the sender's alone; the counts are everyone's
    for other in results[1:]:
        assert other["loaded"][0] == [] and other["loaded"][1].digest is None
        assert other["loaded"][1] == dataclasses.replace(receipt, digest=None)
    # one layer at a time: layer indices never go back
    layers = [int(m.group(1)) for n, _ in sent if (m := re.match(r"model\.layers\.(\d+)\.", n))]
    assert layers == sorted(layers) and len(set(layers)) == TINY["num_hidden_layers"]
    digest = WeightsDigest()
    for name, tensor in sent:
        digest.update(
            name, str(tensor.dtype), tuple(tensor.shape), tensor.view(torch.uint8).numpy()
        )
    assert receipt.digest == digest.hexdigest() and receipt.tensors == len(sent)
    # a files update of the same weights has the stream's digest (safetensors sorts by name)
    assert digest_checkpoint(hf_checkpoint).hexdigest() == receipt.digest
    assert receipt.bytes == sum(t.numel() * t.element_size() for _, t in sent)
    for r in results:
        assert r["inverse"] == [] and r["inverse_count"] > 0


def test_the_digest_names_the_set_of_tensors_dtype_shape_and_bytes(tmp_path):
    from safetensors.torch import save_file

    def digest(*tensors) -> str:
        d = WeightsDigest()
        for name, t in tensors:
            d.update(name, str(t.dtype), tuple(t.shape), t.contiguous().view(torch.uint8).numpy())
        return d.hexdigest()

    a, b = ("a", torch.arange(6.0).reshape(2, 3)), ("b", torch.ones(3, dtype=torch.bfloat16))
    base = digest(a, b)
    assert base.startswith("xxh3-128:") and digest(a, b) == base
    assert digest(b, a) == base  # a set: the order of arrival does not count
    assert digest(a) != base  # cut short
    assert digest(("a", a[1].reshape(3, 2)), b) != base  # same bytes, other shape
    assert digest(("a", a[1].to(torch.int32).view(torch.float32)), b) != base  # other bytes
    assert digest(("c", a[1]), b) != base  # other name
    with pytest.raises(ValueError, match="NUL"):
        digest(("a\0b", b[1]))
    with pytest.raises(ValueError, match="added twice"):
        digest(a, a)
    # the same set in safetensors files, one file or two shards, has the same digest
    save_file(dict([a, b]), str(tmp_path / "model.safetensors"))
    assert digest_checkpoint(tmp_path).hexdigest() == base


def test_virtual_pipeline_stages_are_refused_by_name():
    """One model chunk per pipeline stage streams (test_stream_pipeline.py); an interleaved
    schedule's several chunks per stage are refused before anything moves."""
    from megatron.core import parallel_state
    from support.megatron_cpu import gloo_world_of_one

    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt
    from art_megatron_ext.weights import stream_hf_weights

    shape = GptShape(**TINY)
    with gloo_world_of_one():  # the check reads the parallel state, before any collective
        model = build_gpt(shape)
        parallel_state.set_virtual_pipeline_model_parallel_world_size(2)
        try:
            with pytest.raises(NotImplementedError, match="virtual pipeline stages"):
                stream_hf_weights(model, shape, lambda n, t: None)
        finally:
            parallel_state.set_virtual_pipeline_model_parallel_world_size(None)


def _export_worker(rank: int, world: int, hf_dir: str, out: str) -> dict:
    from support.megatron_cpu import cpu_shim, megatron_parallel

    from art_megatron_ext.lora.hf_weights import load_hf_weights
    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt
    from art_megatron_ext.weights import write_hf_checkpoint

    shape = GptShape(**TINY)
    with cpu_shim(), megatron_parallel(tp=world):
        torch.manual_seed(0)
        model = build_gpt(shape, tensor_parallel=world)
        load_hf_weights(model, hf_dir, shape)
        receipt = write_hf_checkpoint(model, shape, out)
        try:  # every version gets its own directory
            write_hf_checkpoint(model, shape, out)
            again = None
        except FileExistsError as exc:
            again = str(exc)
    return {"digest": receipt.digest, "again": again}


def test_an_export_is_a_sharded_checkpoint_with_the_streams_digest(hf_checkpoint, tmp_path):
    """TP=2: rank 0 writes a layer a shard; the directory has the served checkpoint's layout
    and tensors, and its digest is the stream's (what the server checks)."""
    from safetensors.torch import load_file

    from art_protocol.checkpoint_layout import checkpoint_files, layout_problems, read_layout

    out = tmp_path / "v1"
    results = run_ranks(_export_worker, world_size=2, args=(str(hf_checkpoint), str(out)))
    assert results[1]["digest"] is None  # rank 1 gathered, never hashed
    assert "exists" in results[0]["again"] and results[1]["again"] is None  # rank 0 writes
    assert layout_problems(read_layout(hf_checkpoint), read_layout(out)) == []
    assert len(checkpoint_files(out)) == TINY["num_hidden_layers"] + 2  # embedding, norm+head
    assert digest_checkpoint(out).hexdigest() == results[0]["digest"]
    want = load_file(str(hf_checkpoint / "model.safetensors"))
    got = {}
    for shard in checkpoint_files(out):
        got.update(load_file(str(shard)))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert [p.name for p in tmp_path.iterdir()] == ["v1"]  # no temporary directory left
