"""A version kept for a background stream is the stream, where the user said, untouched by the
next step (marked `gpu` for the cuda case).

`keep_version` replaces the example publisher's pageable host copy of the whole model
(`_snapshot_full` before): kept beside the parameters (GPU memory on a GPU), in pinned host
memory, or as files read back a shard at a time. For each place: the kept tensors are exactly
the stream's (names, dtypes, shapes, bytes) and the receipt's digest is theirs; a training step
after keeping does not change them (no view of a live parameter is kept); they sit where asked
(on the device, pinned on a GPU host, nothing in memory for files); only the sending rank keeps
anything (TP=2). A bad place is refused by name before anything is copied.
CPU twin in CI; the cuda case in the GPU check (megatron-core carried there).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.devices import cpu_and_cuda
from support.gpt_shapes import TINY
from support.train_ranks import run_ranks

pytestmark = pytest.mark.train

WHERE = ("device", "pinned_host", "files")


def _world(device: str):
    if device == "cuda":
        from support.cuda_world import nccl_world_of_one

        return nccl_world_of_one("art_kept_gpu_")
    from support.megatron_cpu import gloo_world_of_one

    return gloo_world_of_one()


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1).clone()


def _collected(produce) -> dict[str, torch.Tensor]:
    got = {}
    produce(lambda name, t: got.__setitem__(name, (t.device.type, t.is_pinned(), _host(t))))
    return got


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_a_kept_version_is_the_stream_where_asked_and_untouched_by_the_next_step(device, tmp_path):
    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt
    from art_megatron_ext.weights import keep_version, stream_hf_weights

    shape = GptShape(**TINY)
    with _world(device):
        torch.manual_seed(0)
        model = build_gpt(shape).to(device)
        want: dict[str, torch.Tensor] = {}
        receipt = stream_hf_weights(model, shape, lambda n, t: want.__setitem__(n, _host(t)))
        kept = {
            where: keep_version(
                model, shape, where, out_dir=tmp_path / "v1" if where == "files" else None
            )
            for where in WHERE
        }
        with torch.no_grad():  # the next step: every parameter moves
            for p in model.parameters():
                p.add_(1.0)
        got = {where: _collected(k.produce) for where, k in kept.items()}
    for where, k in kept.items():
        assert k.receipt == receipt, where
        assert sorted(got[where]) == sorted(want), where
        assert all(torch.equal(got[where][n][2], want[n]) for n in want), where
        assert [(n, d, s) for n, d, s in k.plan()] == [
            (n, t.dtype, tuple(t.shape)) for n, t in _plan_of(k)
        ], where
    assert {d for d, _, _ in got["device"].values()} == {device}  # beside the parameters
    assert {(d, pinned) for d, pinned, _ in got["pinned_host"].values()} == {
        ("cpu", device == "cuda")  # page-locked where there is a GPU to copy from
    }
    assert kept["files"].resident_bytes() == 0  # read back a shard at a time
    assert kept["device"].resident_bytes() == receipt.bytes
    kept["device"].release()
    assert kept["device"].resident_bytes() == 0


def _plan_of(kept) -> list:
    out = []
    kept.produce(lambda name, t: out.append((name, t)))
    return out


def test_a_bad_place_is_refused_by_name_before_anything_is_copied(tmp_path):
    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt
    from art_megatron_ext.weights import keep_version

    shape = GptShape(**TINY)
    from support.megatron_cpu import gloo_world_of_one

    with gloo_world_of_one():
        model = build_gpt(shape)
        with pytest.raises(ValueError, match=r"where='host'.*device, pinned_host, files"):
            keep_version(model, shape, "host")
        with pytest.raises(ValueError, match="needs out_dir"):
            keep_version(model, shape, "files")
        with pytest.raises(ValueError, match="takes no out_dir"):
            keep_version(model, shape, "device", out_dir=tmp_path / "v1")
    assert not (tmp_path / "v1").exists()


def _tp2_worker(rank: int, world: int, out: str) -> dict:
    from support.megatron_cpu import cpu_shim, megatron_parallel

    from art_megatron_ext.lora.tiny_gpt import GptShape, build_gpt
    from art_megatron_ext.weights import keep_version

    shape = GptShape(**TINY)
    with cpu_shim(), megatron_parallel(tp=world):
        torch.manual_seed(0)
        model = build_gpt(shape, tensor_parallel=world)
        device = keep_version(model, shape, "device")
        files = keep_version(model, shape, "files", out_dir=out)
    return {
        "names": [n for n, _ in _plan_of(device)],
        "resident": device.resident_bytes(),
        "digest": (device.digest, files.digest),
        "files": files.path is not None,
        "receipt": dataclasses.replace(device.receipt, digest=None),
    }


def test_only_the_sending_rank_keeps_the_version(tmp_path):
    results = run_ranks(_tp2_worker, world_size=2, args=(str(tmp_path / "v1"),))
    sender, other = results
    assert sender["names"] and sender["resident"] > 0 and sender["files"]
    assert sender["digest"][0] == sender["digest"][1]  # files and memory: the same version
    assert other["names"] == [] and other["resident"] == 0 and not other["files"]
    assert other["digest"] == (None, None)
    assert other["receipt"] == sender["receipt"]  # everyone counted the same stream
