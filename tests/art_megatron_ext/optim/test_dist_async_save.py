"""Background saves on the dist_checkpointing layout (2 gloo ranks, DistributedOptimizer).

One spawn of 2 ranks (DP=2) saves generation 1 synchronously, then two background saves
whose data-file writes are held at a gate: the save call returns while its write is blocked,
the ranks keep training meanwhile, the next save waits for the previous commit, and what is
committed is the state at the call. A second 2-rank spawn SIGKILLs both ranks while a
background save is writing. Then 1 rank (DP=1) loads both directories (resharding DP=2 -> 1)
and continues training, which must match the 2-rank run step for step (eps = 1 keeps Adam's
update linear, so reduction-order noise stays at 1e-6).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from support.distopt_model import ATOL, build, optimizer_builder, train_step
from support.train_ranks import RankError, run_ranks


def _gated_io(gated_generations: dict[int, threading.Event]):
    """A CheckpointIO whose data-file writes of the given generations write their bytes, then
    block until that generation's gate opens; it records writes and commits in order."""
    from art_megatron_ext.optim import CheckpointIO

    class GatedIO(CheckpointIO):
        def __init__(self) -> None:
            self.entered = {g: threading.Event() for g in gated_generations}
            self.events: list[str] = []
            self._lock = threading.Lock()

        def write(self, f, data):
            super().write(f, data)
            parent = Path(f.name).parent.name
            if not parent.startswith("gen-"):  # CURRENT.json.tmp
                return
            generation = int(parent.split("-")[1].split(".")[0])
            with self._lock:
                if not self.events or self.events[-1] != f"write {generation}":
                    self.events.append(f"write {generation}")
            if generation in gated_generations:
                self.entered[generation].set()
                assert gated_generations[generation].wait(300), "the test never opened the gate"

        def replace(self, src, dst):
            if dst.name == "CURRENT.json":
                with self._lock:
                    self.events.append(f"commit {json.loads(src.read_bytes())['generation']}")
            super().replace(src, dst)

    return GatedIO()


def _adapter(ddp) -> dict:
    from art_megatron_ext.lora.export import collect_peft_tensors

    tensors, _ = collect_peft_tensors(ddp.module, "default", dst=None)
    return {k: v.float().numpy() for k, v in tensors.items()}


def _megatron(fn):
    """Run `fn()` with Megatron initialized on CPU at TP=1 (DP = world size)."""
    from megatron.core import parallel_state
    from support.megatron_cpu import cpu_shim, cuda_tensor_type_names

    from art_megatron_ext.lora.cpu_runtime import cpu_megatron

    with cpu_shim(), cuda_tensor_type_names(), cpu_megatron():
        parallel_state.initialize_model_parallel(1, 1)
        try:
            return fn()
        finally:
            parallel_state.destroy_model_parallel()


def _async_worker(rank: int, world_size: int, root: str) -> dict:
    from art_megatron_ext.optim.dist_checkpoint import DistCheckpointer

    def run() -> dict:
        out: dict = {}
        gates = {2: threading.Event(), 3: threading.Event()}
        io = _gated_io(gates)
        ck = DistCheckpointer(Path(root) / "async", io=io)
        ddp = build(tp=1, dtype=torch.float32)
        optimizer = optimizer_builder(ddp, "adam", bf16=False, lr=0.5, eps=1.0)(None)
        rows = slice(rank, rank + 1)
        train_step(ddp, optimizer, 1, rows)
        ck.save(ddp.module, optimizer, step=1, objective="rl")
        train_step(ddp, optimizer, 2, rows)

        first = ck.save_async(ddp.module, optimizer, step=2, objective="rl")
        # The call has returned. Rank 0 (it writes the adapter's main replicas) has started
        # its data-file write in the background and is held at the gate; rank 1 cannot
        # commit without it.
        if rank == 0:
            out["write_started_in_background"] = io.entered[2].wait(300)
        out["returned_before_commit"] = not first.done()
        out["committed_while_writing"] = ck.latest().generation
        train_step(ddp, optimizer, 3, rows)  # the loop goes on (default-group collectives)

        second_called = threading.Event()
        opener = threading.Thread(target=lambda: (second_called.wait(), gates[2].set()))
        opener.start()
        second_called.set()
        second = ck.save_async(ddp.module, optimizer, step=3, objective="rl")
        out["first_done_when_second_returned"] = first.done() and first.result().generation
        out["committed_when_second_returned"] = ck.latest().generation
        if rank == 0:
            assert io.entered[3].wait(300)
        train_step(ddp, optimizer, 4, rows)  # changes what generation 3 would hold if live
        out["adapter_after_4"] = _adapter(ddp)
        gates[3].set()
        manifest = ck.close()
        opener.join()
        out["closed_manifest"] = (manifest.generation, manifest.step, second.done())
        out["events"] = io.events
        out["dirs"] = sorted(p.name for p in (Path(root) / "async").iterdir())
        # A second checkpointer in the same process (the resident store makes one per reload)
        # reuses the checkpoint-only gloo group instead of creating another one.
        other = DistCheckpointer(Path(root) / "async-other")
        other.save_async(ddp.module, optimizer, step=5, objective="rl")
        out["other_committed"] = other.close().generation
        out["gloo_group_shared"] = other._background_group._group is ck._background_group._group
        return out

    return _megatron(run)


def _crash_worker(rank: int, world_size: int, root: str) -> dict:
    import multiprocessing

    from art_megatron_ext.optim.dist_checkpoint import DistCheckpointer

    def run() -> dict:
        never = threading.Event()
        io = _gated_io({2: never})
        ck = DistCheckpointer(Path(root) / "crash", io=io)
        ddp = build(tp=1, dtype=torch.float32)
        optimizer = optimizer_builder(ddp, "adam", bf16=False, lr=0.5, eps=1.0)(None)
        rows = slice(rank, rank + 1)
        train_step(ddp, optimizer, 1, rows)
        ck.save(ddp.module, optimizer, step=1, objective="rl")
        train_step(ddp, optimizer, 2, rows)
        reference = _adapter(ddp)  # collective (gathers the adapter)
        if rank == 0:  # what a job resumed from generation 1 must reproduce
            np.savez(Path(root) / "crash_reference.npz", **reference)
        torch.distributed.barrier()
        ck.save_async(ddp.module, optimizer, step=2, objective="rl")
        if rank == 0:
            assert io.entered[2].wait(300)  # generation 2 is being written in the background
        torch.distributed.barrier()  # both ranks die while rank 0's write is held
        for child in multiprocessing.active_children():  # Megatron's results-queue manager
            child.kill()
        os.kill(os.getpid(), signal.SIGKILL)
        return {}

    return _megatron(run)


def _load_worker(rank: int, world_size: int, root: str) -> dict:
    from art_megatron_ext.optim.dist_checkpoint import DistCheckpointer

    def run() -> dict:
        out: dict = {}
        for case, next_step in (("async", 4), ("crash", 2)):
            torch.manual_seed(123)  # a different init: everything must come from disk
            ddp = build(tp=1, dtype=torch.float32)
            optimizer = optimizer_builder(ddp, "adam", bf16=False, lr=0.5, eps=1.0)(None)
            ck = DistCheckpointer(Path(root) / case)
            loaded = ck.load(ddp.module, optimizer)
            out[f"{case}_loaded"] = (loaded.generation, loaded.step)
            train_step(ddp, optimizer, next_step, slice(None))
            out[case] = _adapter(ddp)
            if case == "crash":  # the debris of the killed save does not hinder the next one
                manifest = ck.save(ddp.module, optimizer, step=2, objective="rl")
                out["after_crash_save"] = manifest.generation
                out["after_crash_dirs"] = sorted(p.name for p in (Path(root) / case).iterdir())
        return out

    return _megatron(run)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_async")
    saved = run_ranks(_async_worker, 2, args=(str(root),), timeout_s=500, daemon=False)
    with pytest.raises(RankError, match="exited abnormally"):
        run_ranks(_crash_worker, 2, args=(str(root),), timeout_s=500, daemon=False)
    crash_dirs = sorted(p.name for p in (root / "crash").iterdir())
    crash_manifest = json.loads((root / "crash" / "CURRENT.json").read_text())
    loaded = run_ranks(_load_worker, 1, args=(str(root),), timeout_s=500, daemon=False)[0]
    reference = dict(np.load(root / "crash_reference.npz"))
    return saved, crash_dirs, crash_manifest, loaded, reference


def test_save_async_returns_while_the_write_is_still_blocked(runs):
    saved, *_ = runs
    assert saved[0]["write_started_in_background"]
    for rank, r in enumerate(saved):
        assert r["returned_before_commit"], rank
        assert r["committed_while_writing"] == 1, rank  # readers still see the last commit


def test_the_next_save_waits_for_the_previous_commit(runs):
    saved, *_ = runs
    for r in saved:
        assert r["first_done_when_second_returned"] == 2
        assert r["committed_when_second_returned"] == 2
        assert r["closed_manifest"] == (3, 3, True)
        assert r["dirs"] == ["CURRENT.json", "gen-00000003.dist"]
    assert all(r["gloo_group_shared"] and r["other_committed"] == 1 for r in saved)
    events = saved[0]["events"]  # rank 0 commits: generation N+1 is written after N's commit
    assert events == ["write 1", "commit 1", "write 2", "commit 2", "write 3", "commit 3"]


def test_what_is_committed_is_the_state_at_the_call_and_reshards_to_one_rank(runs):
    saved, _, _, loaded, _ = runs
    assert loaded["async_loaded"] == (3, 3)
    reference = saved[0]["adapter_after_4"]
    assert loaded["async"].keys() == reference.keys() and reference
    for name, value in reference.items():
        np.testing.assert_allclose(loaded["async"][name], value, atol=ATOL, rtol=0, err_msg=name)


def test_sigkill_during_a_background_save_leaves_the_last_commit(runs):
    _, crash_dirs, crash_manifest, loaded, reference = runs
    assert crash_manifest["generation"] == 1 and crash_manifest["step"] == 1
    assert "gen-00000002.dist" in crash_dirs  # the killed save's debris, never committed
    assert loaded["crash_loaded"] == (1, 1)
    assert loaded["crash"].keys() == reference.keys() and reference
    for name, value in reference.items():
        np.testing.assert_allclose(loaded["crash"][name], value, atol=ATOL, rtol=0, err_msg=name)
    assert loaded["after_crash_save"] == 2
    assert loaded["after_crash_dirs"] == ["CURRENT.json", "gen-00000002.dist"]
