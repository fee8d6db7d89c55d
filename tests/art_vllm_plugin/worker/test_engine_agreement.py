"""A commit's agreement covers every worker of an engine, on a grid of two pipeline stages x
two tensor-parallel ranks (issue 36, item 4).

Four gloo ranks laid out as vLLM lays out one engine (stage-major, tensor-parallel rank
innermost) with a group along each axis, as `compat.step_rides.worker_engine_cpu_groups`
hands them to the worker. The commit fails on worker 3 only (the last stage's second rank):
every worker must answer the same engine-wide failure, and the three that committed must have
put their previous weights back. Before the fix the workers agreed over the tensor-parallel
group only: stage 0 answered success and kept the new weights. The real `-pp 2` server runs
the same path (tests/art_vllm_plugin/engine_core/test_pipeline_parallel.py); this grid adds
the case where both axes have several workers, which no shared server runs on two cores.

The engine-side half: EngineCore settles a commit from every worker's answer
(`engine_core.step_rides.engine_results`), and an answer the workers disagree on is an
unknown outcome, never worker 0's success.
"""

from __future__ import annotations

import pytest
from support.dist import run_ranks

from art_vllm_plugin.engine_core import step_rides as engine_rides
from art_vllm_plugin.engine_core.step_rides import Ride
from art_vllm_plugin.worker import engine_agreement
from art_vllm_plugin.worker import step_rides as worker_rides

TP, PP = 2, 2
FAILING = 3


class _Worker:
    def __init__(self, rank: int):
        self.rank = rank


def _grid_groups(rank: int):
    """This rank's tensor-parallel and pipeline groups (every rank creates every group)."""
    import torch.distributed as dist

    tp = [dist.new_group([s * TP + t for t in range(TP)]) for s in range(PP)]
    pp = [dist.new_group([s * TP + t for s in range(PP)]) for t in range(TP)]
    return [tp[rank // TP], pp[rank % TP]]


def _on_rank(rank: int, world_size: int) -> dict:
    groups = _grid_groups(rank)
    out = {
        "count": engine_agreement.count(groups, 1),
        "gather": engine_agreement.gather(groups, rank),
    }
    rolled_back = []

    def commit(worker, token):
        if worker.rank == FAILING:
            raise RuntimeError("injected failure")
        return {"ok": True, "rank": worker.rank}

    def rollback(worker, token):
        rolled_back.append(token)
        return {"ok": True}

    worker_rides.worker_engine_cpu_groups = lambda: groups  # the grid, as vLLM's groups
    result = worker_rides._commit_everywhere(_Worker(rank), "t1", commit, rollback)
    out["result"] = {k: v for k, v in result.items() if k != "swap_ms"}
    out["rolled_back"] = rolled_back
    return out


@pytest.fixture(scope="module")
def grid() -> list[dict]:
    return run_ranks(_on_rank, world_size=TP * PP, timeout_s=120)


def test_the_agreement_sums_and_gathers_over_the_whole_grid(grid):
    assert [r["count"] for r in grid] == [TP * PP] * (TP * PP)
    assert [r["gather"] for r in grid] == [list(range(TP * PP))] * (TP * PP)


def test_a_commit_failing_on_the_last_stage_fails_and_is_undone_on_every_worker(grid):
    expected = {
        "ok": False,
        "errors": [f"rank {FAILING}: RuntimeError: injected failure"],
        "restored": True,
    }
    assert [r["result"] for r in grid] == [expected] * (TP * PP)
    assert [r["rolled_back"] for r in grid] == [["t1"], ["t1"], ["t1"], []]


def _commit(ok: bool, errors=(), restored=True, swap_ms=1.0) -> dict:
    return {"ok": ok, "errors": list(errors), "restored": restored, "swap_ms": swap_ms}


def test_the_engine_settles_a_commit_from_every_workers_answer():
    rides = [Ride(engine_rides.STAGE, "s", ()), Ride(engine_rides.COMMIT, "c", ())]
    agreed = engine_rides.engine_results(
        rides, [[None, _commit(True, swap_ms=1.0)], [None, _commit(True, swap_ms=3.0)]]
    )
    assert agreed == [None, _commit(True, swap_ms=3.0)]
    # worker 0 alone saw success: the outcome is unknown, not committed
    split = engine_rides.engine_results(
        rides, [[None, _commit(True)], [None, _commit(False, ["rank 1: boom"])]]
    )
    assert split[1]["ok"] is False and split[1]["restored"] is False
    assert split[1]["errors"] == [
        "rank 1: boom",
        "the workers disagree: workers [0] report the commit done",
    ]
