"""Adapter + DistributedOptimizer checkpoints on `dist_checkpointing`, resharded on load.

Two spawns on gloo: 2 ranks save at DP=2 (TP=1) and at TP=2 x DP=1 (sequence parallel),
each after two Adam steps, and record the adapter after a third step; then 1 rank (TP=1,
DP=1) loads each checkpoint into a fresh model and optimizer and takes the same third step.
Equal adapters mean the LoRA tensors, fp32 main params, both moments and the step were all
resharded correctly (eps = 1 keeps Adam's update linear, so float reduction-order noise stays
at 1e-6). The same spawns check the commit record: digests of every file, the previous
generation removed only after the commit, a failed commit keeping the previous generation,
and a flipped byte refused on load.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from support.distopt_model import ATOL, build, optimizer_builder, train_step
from support.train_ranks import run_ranks


class FailManifestReplace:
    """CheckpointIO whose commit rename fails with ENOSPC (the rename is the commit)."""

    def __new__(cls):
        from art_megatron_ext.optim import CheckpointIO

        class _Failing(CheckpointIO):
            def replace(self, src, dst):
                if dst.name == "CURRENT.json":
                    raise OSError(errno.ENOSPC, "No space left on device (injected)", str(dst))
                super().replace(src, dst)

        return _Failing()


def _adapter(ddp) -> dict:
    from art_megatron_ext.lora.export import collect_peft_tensors

    tensors, _ = collect_peft_tensors(ddp.module, "default", dst=None)
    return {k: v.float().numpy() for k, v in tensors.items()}


def _save_worker(rank: int, world_size: int, root: str) -> dict:
    from megatron.core import parallel_state
    from support.megatron_cpu import cpu_shim, cuda_tensor_type_names

    from art_megatron_ext.lora.cpu_runtime import cpu_megatron
    from art_megatron_ext.optim.dist_checkpoint import DistCheckpointer

    out: dict = {}
    with cpu_shim(), cuda_tensor_type_names(), cpu_megatron():
        for tp, case in ((1, "dp2"), (2, "tp2")):
            parallel_state.initialize_model_parallel(tp, 1)
            try:
                ddp = build(tp=tp, dtype=torch.float32)
                optimizer = optimizer_builder(ddp, "adam", bf16=False, lr=0.5, eps=1.0)(None)
                rows = slice(None) if tp == 2 else slice(rank, rank + 1)
                directory = Path(root) / case
                ck = DistCheckpointer(directory)
                train_step(ddp, optimizer, 1, rows)
                first = ck.save(ddp.module, optimizer, step=1, objective="rl")
                train_step(ddp, optimizer, 2, rows)
                if case == "dp2":  # a failed commit keeps generation 1 and its files
                    failing = DistCheckpointer(directory, io=FailManifestReplace())
                    try:
                        failing.save(ddp.module, optimizer, step=2, objective="rl")
                        out["failed_commit"] = None
                    except Exception as exc:
                        out["failed_commit"] = type(exc).__name__
                    out["after_failure_generation"] = ck.latest().generation
                    out["after_failure_dirs"] = sorted(p.name for p in directory.iterdir())
                second = ck.save(ddp.module, optimizer, step=2, objective="rl")
                out[f"{case}_generations"] = (first.generation, second.generation)
                out[f"{case}_dirs"] = sorted(p.name for p in directory.iterdir())
                train_step(ddp, optimizer, 3, rows)
                out[case] = _adapter(ddp)
                if case == "dp2":
                    out.update(_resident_save(Path(root) / "resident", rank))
            finally:
                parallel_state.destroy_model_parallel()
    return out


def _resident_save(directory: Path, rank: int) -> dict:
    """The resident store on the dist_checkpointing layout, at DP=2."""
    from art_megatron_ext.optim import CheckpointLayout, ResidentKey, ResidentOptimizerStore

    ddp = build(tp=1, dtype=torch.float32)
    store = ResidentOptimizerStore(layout=CheckpointLayout.DIST)
    job = store.acquire(
        ResidentKey("s", "rl", directory),
        ddp,
        optimizer_builder(ddp, "adam", bf16=False, lr=0.5, eps=1.0),
    )
    out = {"resident_first": job.residency.value}
    rows = slice(rank, rank + 1)
    train_step(ddp, job.optimizer, 1, rows)
    job.save(1)
    train_step(ddp, job.optimizer, 2, rows)
    job.save_async(2)  # committed in the background while step 3 runs
    train_step(ddp, job.optimizer, 3, rows)
    manifest = job.wait_for_saves()
    out["resident_async"] = (manifest.generation, manifest.step)
    out["resident"] = _adapter(ddp)
    return out


def _resident_load(directory: Path) -> dict:
    from art_megatron_ext.optim import (
        CheckpointLayout,
        ObjectiveMismatchError,
        ResidentKey,
        ResidentOptimizerStore,
    )

    torch.manual_seed(321)
    ddp = build(tp=1, dtype=torch.float32)
    build_optimizer = optimizer_builder(ddp, "adam", bf16=False, lr=0.5, eps=1.0)
    store = ResidentOptimizerStore(layout=CheckpointLayout.DIST)
    out: dict = {}
    try:
        store.acquire(ResidentKey("s", "sft", directory), ddp, build_optimizer)
    except ObjectiveMismatchError as exc:
        out["resident_objective_refused"] = str(exc)
    job = store.acquire(ResidentKey("s", "rl", directory), ddp, build_optimizer)
    out["resident_loaded"] = (job.residency.value, job.step)
    train_step(ddp, job.optimizer, 3, slice(None))
    out["resident"] = _adapter(ddp)
    return out


def _load_worker(rank: int, world_size: int, root: str) -> dict:
    from megatron.core import parallel_state
    from support.megatron_cpu import cpu_shim, cuda_tensor_type_names

    from art_megatron_ext.lora.cpu_runtime import cpu_megatron
    from art_megatron_ext.optim import CheckpointCorruptError
    from art_megatron_ext.optim.dist_checkpoint import DistCheckpointer

    out: dict = {}
    with cpu_shim(), cuda_tensor_type_names(), cpu_megatron():
        parallel_state.initialize_model_parallel(1, 1)
        try:
            for case in ("dp2", "tp2"):
                torch.manual_seed(123)  # a different init: everything must come from disk
                ddp = build(tp=1, dtype=torch.float32)
                optimizer = optimizer_builder(ddp, "adam", bf16=False, lr=0.5, eps=1.0)(None)
                loaded = DistCheckpointer(Path(root) / case).load(ddp.module, optimizer)
                out[f"{case}_loaded_step"] = loaded.step
                train_step(ddp, optimizer, 3, slice(None))
                out[case] = _adapter(ddp)
            out.update(_resident_load(Path(root) / "resident"))
            # Flip one byte of a data file: the load is refused, naming the file.
            (data,) = sorted((Path(root) / "dp2").glob("gen-*.dist/__0_0.distcp"))
            raw = bytearray(data.read_bytes())
            raw[len(raw) // 2] ^= 1
            data.write_bytes(bytes(raw))
            ddp = build(tp=1, dtype=torch.float32)
            optimizer = optimizer_builder(ddp, "adam", bf16=False, lr=0.5, eps=1.0)(None)
            try:
                DistCheckpointer(Path(root) / "dp2").load(ddp.module, optimizer)
                out["corrupt"] = None
            except CheckpointCorruptError as exc:
                out["corrupt"] = str(exc)
        finally:
            parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("distckpt")
    saved = run_ranks(_save_worker, 2, args=(str(root),), timeout_s=400, daemon=False)
    manifests = {c: json.loads((root / c / "CURRENT.json").read_text()) for c in ("dp2", "tp2")}
    digests_ok = {
        c: all(
            xxhash.xxh3_128((root / c / m["directory"] / f["name"]).read_bytes()).hexdigest()
            == f["digest"]
            for f in m["files"]
        )
        for c, m in manifests.items()
    }
    loaded = run_ranks(_load_worker, 1, args=(str(root),), timeout_s=400, daemon=False)[0]
    return saved, manifests, digests_ok, loaded


@pytest.mark.parametrize("case", ["dp2", "tp2"])
def test_saved_at_two_ranks_loads_at_one_and_continues_identically(runs, case):
    saved, _, _, loaded = runs
    assert loaded[f"{case}_loaded_step"] == 2
    reference = saved[0][case]
    assert loaded[case].keys() == reference.keys() and reference
    for name, value in reference.items():
        np.testing.assert_allclose(loaded[case][name], value, atol=ATOL, rtol=0, err_msg=name)


@pytest.mark.parametrize("case", ["dp2", "tp2"])
def test_manifest_names_the_generation_and_digests_every_file(runs, case):
    saved, manifests, digests_ok, _ = runs
    m = manifests[case]
    assert m["format"] == "art-pipeline/dist-checkpoint" and m["digest"] == "xxh3-128"
    assert m["generation"] == 2 and m["step"] == 2 and m["world_size"] == 2
    assert m["directory"] == "gen-00000002.dist"
    assert any(f["name"].endswith(".distcp") for f in m["files"])
    assert digests_ok[case]
    # the previous generation was removed by the commit of the next one
    assert saved[0][f"{case}_dirs"] == ["CURRENT.json", "gen-00000002.dist"]


def test_failed_commit_keeps_the_previous_generation(runs):
    saved, _, _, _ = runs
    r0 = saved[0]
    assert r0["failed_commit"] in ("OSError", "CheckpointSaveError")
    assert saved[1]["failed_commit"] == "CheckpointSaveError"
    assert r0["after_failure_generation"] == 1
    assert "gen-00000001.dist" in r0["after_failure_dirs"]


def test_a_flipped_byte_is_refused_naming_the_file(runs):
    _, _, _, loaded = runs
    assert loaded["corrupt"] is not None and "__0_0.distcp" in loaded["corrupt"]
    assert "nothing was loaded" in loaded["corrupt"]


def test_a_plain_torch_optimizer_is_refused_with_a_message(tmp_path):
    from art_megatron_ext.optim.dist_checkpoint import DistCheckpointer

    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="needs Megatron's DistributedOptimizer") as info:
        DistCheckpointer(tmp_path / "ck").save(
            model, torch.optim.AdamW(model.parameters()), step=1, objective="rl"
        )
    assert "AdamW" in str(info.value)
    assert not (tmp_path / "ck").exists()


def test_resident_store_on_the_dist_layout_saves_at_dp2_and_loads_at_dp1(runs):
    saved, _, _, loaded = runs
    assert saved[0]["resident_first"] == "rebuilt"
    assert saved[0]["resident_async"] == saved[1]["resident_async"] == (2, 2)
    assert "holds 'rl' optimizer state" in loaded["resident_objective_refused"]
    assert loaded["resident_loaded"] == ("loaded", 2)
    reference = saved[0]["resident"]
    assert loaded["resident"].keys() == reference.keys()
    for name, value in reference.items():
        np.testing.assert_allclose(loaded["resident"][name], value, atol=ATOL, rtol=0, err_msg=name)
