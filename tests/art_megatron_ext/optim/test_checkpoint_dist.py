"""2-rank gloo group: checkpoint round trip, failure agreement, world size, resident reuse."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
from support.train_ranks import run_ranks

from art_megatron_ext.optim import (
    CheckpointConfig,
    CheckpointIO,
    CheckpointSaveError,
    CheckpointWorldSizeError,
    ResidentKey,
    ResidentOptimizerStore,
    ShardedCheckpointer,
)

WORLD = 2


def rank_state(rank: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    bits = torch.randint(-(2**31), 2**31 - 1, (256,), generator=g, dtype=torch.int64)
    return {
        "fp32": torch.randn(128, 4, generator=g),
        "bf16": torch.randn(77, generator=g).to(torch.bfloat16),
        # arbitrary 32-bit patterns (NaN payloads, denormals) viewed as fp32: bit-exactness
        "raw_fp32": bits.to(torch.int32).view(torch.float32),
        "exp_avg_sq": torch.rand(64, generator=g, dtype=torch.float64),
        "rank": rank,
    }


def bit_equal(a: dict, b: dict) -> bool:
    for key, value in a.items():
        other = b[key]
        if isinstance(value, torch.Tensor):
            if value.dtype != other.dtype or value.shape != other.shape:
                return False
            if not torch.equal(value.view(torch.uint8), other.view(torch.uint8)):
                return False
        elif value != other:
            return False
    return a.keys() == b.keys()


class Rank1DiskFull(CheckpointIO):
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def fsync(self, f):
        if self.rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device (injected)", f.name)
        super().fsync(f)


def _worker(rank: int, world_size: int, root: str) -> dict:
    out: dict = {}
    round_trip = Path(root) / "round_trip"
    saved = rank_state(rank, seed=1)
    manifest = ShardedCheckpointer(CheckpointConfig(round_trip)).save(saved, step=5, objective="rl")
    loaded = ShardedCheckpointer(CheckpointConfig(round_trip)).load()
    out["bit_exact"] = bit_equal(saved, loaded.state)
    out["loaded_step"] = loaded.step
    out["manifest_ranks"] = [r.rank for r in manifest.files]
    out["manifest_world"] = manifest.world_size

    failing = Path(root) / "failing"
    first = rank_state(rank, seed=2)
    ShardedCheckpointer(CheckpointConfig(failing)).save(first, step=1, objective="rl")
    try:
        ShardedCheckpointer(CheckpointConfig(failing), io=Rank1DiskFull(rank)).save(
            rank_state(rank, seed=3), step=2, objective="rl"
        )
        out["failure"] = None
    except OSError as exc:
        out["failure"] = ("OSError", exc.errno)
    except CheckpointSaveError as exc:
        out["failure"] = ("CheckpointSaveError", str(exc))
    after = ShardedCheckpointer(CheckpointConfig(failing)).load()
    out["after_failure_step"] = after.step
    out["after_failure_is_first"] = bit_equal(first, after.state)

    # Resident store: ranks agree on reuse; one rank's failed job makes every rank reload.
    torch.manual_seed(rank)
    model = torch.nn.Linear(4, 4)
    store = ResidentOptimizerStore()
    key = ResidentKey("session", "rl", Path(root) / "resident")
    steps = []
    job = store.acquire(key, model, lambda ps: torch.optim.AdamW(ps, lr=0.1))
    steps.append(job.residency.value)
    job.save(1)
    job = store.acquire(key, model, lambda ps: torch.optim.AdamW(ps, lr=0.1))
    steps.append(job.residency.value)
    if rank == 1:
        job.mark_failed(RuntimeError("rank-local failure"))
    job = store.acquire(key, model, lambda ps: torch.optim.AdamW(ps, lr=0.1))
    steps.append(job.residency.value)
    out["resident"] = steps
    out["resident_reason"] = job.reason
    return out


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_ckpt")
    return root, run_ranks(_worker, world_size=WORLD, args=(str(root),))


def test_two_rank_round_trip_is_bit_exact(dist_results):
    _, results = dist_results
    for rank, result in enumerate(results):
        assert result["bit_exact"], f"rank {rank}"
        assert result["loaded_step"] == 5
        assert result["manifest_ranks"] == [0, 1] and result["manifest_world"] == WORLD


def test_one_rank_failing_fails_the_save_on_every_rank(dist_results):
    _, (r0, r1) = dist_results
    assert r1["failure"] == ("OSError", errno.ENOSPC)
    kind, message = r0["failure"]
    assert kind == "CheckpointSaveError"
    assert "rank 1" in message and "stays in effect" in message
    for result in (r0, r1):
        assert result["after_failure_step"] == 1 and result["after_failure_is_first"]


def test_loading_a_two_rank_checkpoint_on_one_rank_is_refused(dist_results):
    root, _ = dist_results
    with pytest.raises(CheckpointWorldSizeError, match="saved by 2 ranks but this job has 1"):
        ShardedCheckpointer(CheckpointConfig(root / "round_trip")).load()


def test_resident_reuse_is_agreed_by_all_ranks(dist_results):
    _, (r0, r1) = dist_results
    assert r0["resident"] == r1["resident"] == ["rebuilt", "reused", "loaded"]
    assert r0["resident_reason"] == "another rank cannot reuse its state"
    assert "previous job failed" in r1["resident_reason"]
