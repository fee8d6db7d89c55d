"""`ART_REQUIRE_GPU=1` (tests/conftest.py) turns skipped GPU tests into failures.

Runs pytest on a throwaway test file next to a copy of the repository's conftest.py, once
without the variable (the GPU test skips with its reason, as on any CPU box) and once with it
(the same skip is a failure naming the reason), which is what bench/gpu_check.sh relies on.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"
TESTS = """
import pytest

@pytest.mark.gpu
@pytest.mark.skipif(True, reason="needs an sm_90 GPU")
def test_marked_gpu_and_skipped():
    pass

@pytest.mark.gpu
def test_marked_gpu_skips_at_run_time():
    pytest.skip("library not built")

@pytest.mark.skipif(True, reason="checks the CPU-only behaviour")
def test_cpu_only_skip_is_left_alone():
    pass

def test_plain():
    pass
"""


MODULE_SKIP = 'import pytest\npytest.skip("no megatron here", allow_module_level=True)\n'


def _run(tmp_path: Path, require: str | None) -> subprocess.CompletedProcess:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_sample.py").write_text(TESTS)
    (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    # pythonpath: the conftest loads the serve suite's server pool (tests/support), as the
    # repository's pyproject does
    (tmp_path / "pytest.ini").write_text(
        f"[pytest]\npythonpath = {CONFTEST.parent}\nmarkers =\n  gpu: needs a CUDA GPU\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "ART_REQUIRE_GPU"}
    if require is not None:
        env["ART_REQUIRE_GPU"] = require
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
         "--continue-on-collection-errors", str(tmp_path)],  # as bench/gpu_check.sh runs it
        cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {
        require: _run(tmp_path_factory.mktemp(f"require-{require}"), require)
        for require in (None, "0", "1")
    }


def test_without_the_variable_gpu_tests_skip(runs):
    for require in (None, "0"):  # unset, or 0: off
        proc = runs[require]
        assert proc.returncode == 0, proc.stdout
        assert "1 passed, 4 skipped" in proc.stdout


def test_with_the_variable_gpu_skips_fail_with_their_reason(runs):
    proc = runs["1"]
    assert proc.returncode == 1, proc.stdout
    # a skip in setup (skipif) is a setup failure, which pytest counts as an error
    assert "1 failed, 1 passed, 1 skipped, 2 errors" in proc.stdout  # 2nd: the module skip
    assert "ART_REQUIRE_GPU=1: GPU test was skipped: needs an sm_90 GPU" in proc.stdout
    assert "ART_REQUIRE_GPU=1: GPU test was skipped: library not built" in proc.stdout


def test_with_the_variable_a_module_skipped_at_collection_fails(runs):
    text = runs["1"].stdout
    assert "ART_REQUIRE_GPU=1: collecting test_module_skip.py was skipped" in text
    assert "no megatron here" in text
