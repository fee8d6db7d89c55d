"""`support.train_ranks.run_ranks` (ranks forked from a preloaded server) gives its ranks
what a spawned rank has, and reports failures as `support.dist.run_ranks` does.

The training-side multi-rank tests run on it; what would differ silently from spawn is held
here: the environment and working directory of the moment of the launch, output into the
running test's capture, fresh random state per rank, and no test state leaking from one
launch into the next.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
from support.train_ranks import PRELOAD, RankError, run_ranks


def _facts(rank: int, world: int, marker: str) -> dict:
    import numpy as np
    import torch
    import torch.distributed as dist

    print(f"rank {rank} says {marker}")
    print(f"rank {rank} complains", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    gathered = [None] * world
    dist.all_gather_object(gathered, rank)
    seed = torch.initial_seed()
    torch.manual_seed(1000 + rank)  # in this rank only: the next launch starts from the server
    return {
        "rank": rank,
        "world": world,
        "env": os.environ.get("ART_TEST_TRAIN_RANKS"),
        "torch_seed": seed,
        "cwd": os.getcwd(),
        "numpy": int(np.random.randint(0, 2**31 - 1)),
        "gathered": gathered,
        "preloaded": sorted(m for m in PRELOAD if m in sys.modules),
        "pid": os.getpid(),
    }


def _raises(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one's input is bad")
    time.sleep(3600)  # a peer that would wait for rank 1 in a collective


def _dies(rank: int, world: int) -> None:
    if rank == 0:
        os._exit(5)
    time.sleep(3600)


def _hangs(rank: int, world: int) -> None:
    time.sleep(3600)


def test_ranks_get_the_launch_environment_cwd_and_streams(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("ART_TEST_TRAIN_RANKS", "from the test")
    monkeypatch.chdir(tmp_path)
    got = run_ranks(_facts, 3, ("hello",))
    assert [r["rank"] for r in got] == [0, 1, 2] and {r["world"] for r in got} == {3}
    assert all(r["gathered"] == [0, 1, 2] for r in got)  # one gloo group across the ranks
    assert {r["env"] for r in got} == {"from the test"}
    assert {r["cwd"] for r in got} == {str(tmp_path)}
    assert len({r["numpy"] for r in got}) == 3, "ranks share numpy's random state"
    assert len({r["pid"] for r in got}) == 3
    assert all(r["preloaded"] == sorted(PRELOAD) for r in got)  # imported by the server
    out, err = capfd.readouterr()
    assert all(f"rank {r} says hello" in out and f"rank {r} complains" in err for r in range(3))
    # the next launch forks the server again: what a rank did is not left over, the
    # environment is the parent's of this launch, numpy's state is new
    monkeypatch.setenv("ART_TEST_TRAIN_RANKS", "changed")
    again = run_ranks(_facts, 1, ("again",))[0]
    assert {r["torch_seed"] for r in got} == {again["torch_seed"]}
    assert again["env"] == "changed" and again["numpy"] not in {r["numpy"] for r in got}


def test_a_raising_rank_is_reported_with_its_traceback_and_its_peer_killed():
    start = time.monotonic()
    with pytest.raises(RankError, match=r"(?s)rank 1 of 2 failed:.*rank one's input is bad"):
        run_ranks(_raises, 2, timeout_s=300)
    assert time.monotonic() - start < 60


def test_a_dead_rank_is_named_with_its_exit_code():
    with pytest.raises(RankError, match=r"ranks exited abnormally \(exit codes \{0: 5\}\)"):
        run_ranks(_dies, 2, timeout_s=300)


def test_a_hung_rank_is_killed_at_the_deadline():
    start = time.monotonic()
    with pytest.raises(RankError, match=r"ranks \[0\] did not finish within 3 s"):
        run_ranks(_hangs, 1, timeout_s=3)
    assert time.monotonic() - start < 60
