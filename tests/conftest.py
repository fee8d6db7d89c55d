"""Repository-wide pytest hooks: `ART_REQUIRE_GPU=1` turns skipped GPU tests into failures.

Why: on a CPU machine a test marked `gpu` skips with its reason (its CPU twin runs instead),
which is right there. On the lent GPU machine (bench/gpu_check.sh sets the variable) the same
skip would mean a check silently did not happen: a wrong arch, a missing library, a fixture
that bailed out. There, a skip of a `gpu`-marked test, or of a whole module during
collection, is reported as a failure carrying the skip's reason.
"""

from __future__ import annotations

import os

import pytest

REQUIRE_GPU_ENV = "ART_REQUIRE_GPU"

#: Shared `vllm serve` processes, one per configuration (tests/support/server_pool.py);
#: `--servers shared|own` to run one half of the serve suite (tests/support/server_split.py);
#: the 25 slowest modules at the end of a run (tests/support/module_times.py); the model
#: runner the servers use (tests/support/model_runner.py).
pytest_plugins = [
    "support.server_pool",
    "support.server_split",
    "support.module_times",
    "support.model_runner",
]


def _require_gpu() -> bool:
    return os.environ.get(REQUIRE_GPU_ENV, "") not in ("", "0")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else longrepr
    return str(reason).removeprefix("Skipped: ")


def _as_failure(report, what: str) -> None:
    report.outcome = "failed"
    report.longrepr = f"{REQUIRE_GPU_ENV}=1: {what} was skipped: {_skip_reason(report)}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if (
        _require_gpu()
        and report.skipped
        and not hasattr(report, "wasxfail")
        and item.get_closest_marker("gpu") is not None
    ):
        _as_failure(report, "GPU test")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if _require_gpu() and report.skipped:
        _as_failure(report, f"collecting {collector.nodeid}")
