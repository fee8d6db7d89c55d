"""The stream in the layout a GPU trainer has: a bf16 model wrapped in Megatron's
`Float16Module` and `DistributedDataParallel`, on two data-parallel ranks.

- Names are the model's own inside the wrappers (before: `KeyError` on
  `embedding.word_embeddings.weight`, the wrapped names being `module.module.embedding...`).
- One sender, global rank 0: before, "TP rank 0" sent, which every data-parallel replica is,
  so `write_hf_checkpoint` had every replica write and rename into one directory.
- The stream equals the unwrapped model's, and the written directory's digest is the receipt's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.gpt_shapes import TINY
from support.train_ranks import run_ranks

pytestmark = pytest.mark.train


def _collect(model, shape, **kwargs) -> tuple[list, object]:
    """([(hf name, bf16 bits as int16 numpy)], receipt): numpy has no bfloat16."""
    from art_megatron_ext.weights import stream_hf_weights

    got = []
    receipt = stream_hf_weights(model, shape, lambda n, t: got.append((n, t.clone())), **kwargs)
    return [(n, t.view(torch.int16).numpy()) for n, t in got], receipt


def _worker(rank: int, world: int, out_dir: str) -> dict:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module
    from support.megatron_cpu import cpu_shim, megatron_parallel

    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt
    from art_megatron_ext.weights import write_hf_checkpoint

    shape = GptShape(**TINY)
    with cpu_shim(), megatron_parallel(tp=1):
        torch.manual_seed(0)
        model = build_gpt(shape, params_dtype=torch.bfloat16)
        config = dataclasses.replace(model.config, bf16=True)
        wrapped = DistributedDataParallel(
            config, DistributedDataParallelConfig(), Float16Module(config, model)
        )
        plain = _collect(model, shape, send=True)  # the model itself (cast to bf16 by now)
        assert next(iter(dict(wrapped.named_parameters()))).startswith("module.module.")
        sent = _collect(wrapped, shape)
        receipt = write_hf_checkpoint(wrapped, shape, out_dir)
    return {"plain": plain, "sent": sent, "written": receipt}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp2") / "v1"
    return out, run_ranks(_worker, world_size=2, args=(str(out),))


def test_a_wrapped_bf16_model_streams_its_own_names(results):
    _, (first, second) = results
    names = [n for n, _ in first["sent"][0]]
    assert names and names == [n for n, _ in first["plain"][0]]
    for (_, got), (_, want) in zip(first["sent"][0], first["plain"][0], strict=True):
        assert (got == want).all()
    assert first["sent"][1] == first["plain"][1]
    assert second["sent"][1] == dataclasses.replace(first["sent"][1], digest=None)  # no hash


def test_only_global_rank_zero_sends_and_writes(results):
    from art_protocol.weights_digest import digest_checkpoint

    out, (first, second) = results
    assert second["sent"][0] == []  # data-parallel rank 1 is TP rank 0 too, and sent nothing
    assert second["written"] == dataclasses.replace(first["written"], digest=None)
    assert digest_checkpoint(out).hexdigest() == first["written"].digest
    assert [p.name for p in out.parent.iterdir()] == ["v1"]  # no second writer's leftovers
