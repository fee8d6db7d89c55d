"""bench/gpu_check.sh checks its own logic on CPU (`--dry-run`), and its helpers' harnesses run.

The real run needs the lent H200; what can go wrong before the first kernel launches (a stage
list that stops early, a carry dir not found, a verdict row nobody writes, a harness bug in
the multi-rank timing) is checked here, so the 15 minutes of device time go to the kernels.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_check.sh"
STAGES = (
    "preflight", "build", "gpu-tests", "megatron-gpu-tests", "example-trainer",
    "hybridep-ranks", "time-grouped-gemm", "time-hybridep", "time-flex-attention",
    "async-provenance",
)  # fmt: skip


def _helper_checks(name: str) -> list[str]:
    """The verdict rows a bench/gpu_check_*.py helper writes (its CHECKS list)."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(REPO / "bench"))
    return list(module.CHECKS)


def _fake_cutlass(root: Path, version=("9", "8", "7")) -> Path:
    """The files the preflight and `find_cutlass` look for, with a version nothing else has."""
    (root / "include" / "cutlass").mkdir(parents=True)
    (root / "include" / "cute").mkdir()
    (root / "tools" / "util" / "include" / "cutlass" / "util").mkdir(parents=True)
    major, minor, patch = version
    defines = zip(("MAJOR", "MINOR", "PATCH"), (major, minor, patch), strict=True)
    (root / "include" / "cutlass" / "version.h").write_text(
        "".join(f"#define CUTLASS_{name} {value}\n" for name, value in defines)
    )
    (root / "include" / "cute" / "tensor.hpp").write_text("#pragma once\n")
    (root / "tools/util/include/cutlass/util/packed_stride.hpp").write_text("#pragma once\n")
    return root


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ART_CUTLASS_DIR", "OUT")}
    env.update(PYTHON=sys.executable, **extra)
    return env


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-check")
    carry = tmp / "carry"
    _fake_cutlass(carry / "cutlass")
    out = tmp / "out"
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"], cwd=tmp, capture_output=True, text=True,
        env=_env(OUT=str(out), ART_GPU_CARRY_DIR=str(carry)), timeout=600,
    )  # fmt: skip
    (tmp / "stdout.txt").write_text(proc.stdout)  # kept for diagnosis next to $OUT
    return proc, out, carry


def test_dry_run_exits_zero_and_writes_its_log(dry_run):
    proc, out, _ = dry_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / "gpu_check.log").read_text() == proc.stdout
    assert len(list(out.iterdir())) <= 8  # what `run` brings back from $OUT


def test_dry_run_finds_the_carry_dir_and_its_cutlass_headers(dry_run):
    proc, _, carry = dry_run
    text = proc.stdout
    assert f"carry dir {carry}: found" in text
    assert f"ART_CUTLASS_DIR={carry}/cutlass" in text
    assert f"ART_PIPELINE_KERNEL_CACHE={carry}/kernel-cache" in text
    # the fake tree's version proves the headers came from the carry dir, not nvidia-cutlass
    assert re.search(r"preflight: cutlass headers: OK CUTLASS 9\.8\.7 from \$ART_CUTLASS_DIR", text)
    assert "preflight: carry dir: OK" in text


def test_dry_run_preflight_names_what_is_missing_on_cpu(dry_run):
    text = dry_run[0].stdout
    for check in ("torch", "gpu", "nvcc", "carry dir", "cutlass headers", "pytest"):
        assert re.search(rf"^preflight: {check}: (OK|FAIL) ", text, re.M), check
    assert "preflight: gpu: FAIL RuntimeError: no CUDA device is visible" in text
    assert "PREFLIGHT FAILED (1 required piece(s) missing)" in text


def test_dry_run_lists_every_stage_with_its_timeout(dry_run):
    """Each stage is announced with a positive timeout inside the budget (the script caps each
    one by what the 360 s budget has left after the later stages' floors)."""
    text = dry_run[0].stdout
    assert f"stages: {' '.join(STAGES)}" in text
    for stage in ("build", *STAGES[2:-1]):
        found = re.search(rf"^== stage {stage} \(timeout (\d+) s", text, re.M)
        assert found and 0 < int(found.group(1)) <= 360, stage
    for stage in STAGES[2:-1]:
        assert re.search(rf"^\| {stage} \| - \| 0 \| not run: dry run \|$", text, re.M), stage


def test_dry_run_selects_gpu_tests_without_collection_errors(dry_run):
    """Both test stages select gpu-marked files (Megatron twins included) that collect here
    and import nothing the GPU image lacks (hypothesis, transformer_engine, vLLM)."""
    text = dry_run[0].stdout
    for stage in ("gpu-tests", "megatron-gpu-tests", "example-trainer"):
        found = re.search(rf"^{stage}: (\d+) test\(s\) selected by -m gpu", text, re.M)
        assert found and int(found.group(1)) > 0, stage
        assert f"{stage}: FAIL" not in text
    assert "tests/hybridep/test_layout_gpu.py" in text  # a file, not the hypothesis module
    assert "tests/hybridep/test_layout.py" not in text
    assert "test_no_host_syncs_gpu.py" in text
    assert "test_hf_stream_gpu.py::test_a_model_on_the_device_streams_from_the_device[cuda]" in text
    assert "test_trainer_on_device.py::test_the_example_trainer_learns_on_its_device[cuda]" in text


def test_dry_run_plan_gives_every_row_its_stage_oracle_and_time(dry_run):
    text = dry_run[0].stdout
    plan = text[text.index("== plan") : text.index("== stage preflight")]
    rows = re.findall(r"^\| (.+?) \| ([a-z-]+) \| (\d+) \| (\d+) \| (.+) \|$", plan, re.M)
    checks = [r[0] for r in rows if r[0] != "check"]
    assert len(checks) == len(set(checks)) == len(_all_checks())
    assert set(checks) == set(_all_checks())
    for check, stage, limit, floor, oracle in rows:
        assert stage in STAGES and 0 < int(floor) <= int(limit) <= 360, check
        assert len(oracle) > 10, check


def _all_checks() -> list[str]:
    return [
        "kernels build (both libraries)",
        "GPU tests (ART_REQUIRE_GPU=1, skips fail)",
        "Megatron GPU twins (carried megatron-core)",
        "Pipeline RL example trainer on CUDA (recorded rollouts)",
        *_helper_checks("gpu_check_grouped_gemm"),
        *_helper_checks("gpu_check_hybridep"),
        *_helper_checks("gpu_check_flex_attention"),
        "async-scheduling provenance",
    ]


def test_dry_run_prints_every_verdict_not_run(dry_run):
    text = dry_run[0].stdout
    table = text[text.index("== verdicts") :]
    checks = _all_checks()
    for check in checks:
        assert f"| {check} | - | - | not run |" in table, check
    assert table.count("| not run |") == len(checks)
    assert "async-provenance: not runnable here" in text


def test_preflight_fails_loudly_without_carry_dir_or_with_incomplete_cutlass(tmp_path):
    broken = tmp_path / "cutlass"
    (broken / "include" / "cutlass").mkdir(parents=True)
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check_preflight.py")], cwd=tmp_path,
        capture_output=True, text=True, timeout=300,
        env=_env(ART_GPU_CARRY_DIR=str(tmp_path / "absent"), ART_CUTLASS_DIR=str(broken)),
    )  # fmt: skip
    text = proc.stdout
    assert "carry dir: FAIL" in text and "run `make gpu-carry` first" in text
    assert re.search(r"cutlass headers: FAIL .*ART_CUTLASS_DIR.*missing", text)
    assert proc.returncode >= 2  # each missing required piece counts


def test_grouped_gemm_timing_harness_runs_on_cpu():
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check_grouped_gemm.py"), "--dry-run",
         "--iters", "1"], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for check in _helper_checks("gpu_check_grouped_gemm"):
        assert f"dry run: {check}: " in proc.stdout
    assert proc.stdout.count("| skewed |") == 6 and proc.stdout.count("| uniform |") == 6


def test_hybridep_harnesses_run_on_cpu():
    """The one-process kernel timing (the reference in the kernels' place) and the W-process
    fused-path check (the torch backend in every rank) run their code on tiny shapes, and
    every row says what it would record."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check_hybridep.py"), "--dry-run"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(
        r"^\| 2 \| dispatch \| [\d.]+ \| [\d.]+ \| \d+ \| \d+% \| True \|$", proc.stdout, re.M
    )
    assert re.search(r"^\| 4 \| combine \| .* \| True \|$", proc.stdout, re.M)
    assert re.search(r"^\| 2 \| dispatch\+combine \| - \| [\d.]+ \| torch path ", proc.stdout, re.M)
    assert (
        "HybridEP W=2 processes: fused paths bitwise = torch backend: bitwise True" in proc.stdout
    )
    assert (
        "HybridEP H=12 (unaligned rows): dispatch+combine bitwise: layout True, dispatch "
        "True, combine True" in proc.stdout
    )
    assert re.search(r"^elapsed: time-hybridep total: [\d.]+ s$", proc.stdout, re.M)


def _bench_import(name: str):
    sys.path.insert(0, str(REPO / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO / "bench"))


# The multi-process checks run their ranks through tests/support/dist.run_ranks: on the lent
# GPU a dead, stuck or raising rank must cost a FAIL row, never the rest of the check's time.
def test_run_ranks_names_a_rank_that_died_without_waiting_forever():
    from support import rank_behaviours
    from support.dist import RankError, run_ranks

    start = time.monotonic()
    with pytest.raises(RankError, match=r"ranks exited abnormally \(exit codes \{1: 3\}\)"):
        run_ranks(rank_behaviours.rank_one_dies, 2, ({"survivor_sleep_s": 600},), timeout_s=120)
    assert time.monotonic() - start < 60  # named as soon as it is seen dead, not at the deadline


def test_run_ranks_kills_and_names_a_rank_past_the_deadline():
    from support import rank_behaviours
    from support.dist import RankError, run_ranks

    with pytest.raises(RankError, match=r"ranks \[1\] did not finish within 20 s"):
        run_ranks(rank_behaviours.rank_one_hangs, 2, ({},), timeout_s=20)


def test_run_ranks_fails_fast_on_a_raising_rank_and_returns_results_in_order():
    from support import rank_behaviours
    from support.dist import RankError, run_ranks

    start = time.monotonic()
    with pytest.raises(RankError, match=r"(?s)rank 0 of 2 failed:.*rank zero's input is bad"):
        run_ranks(rank_behaviours.rank_zero_raises, 2, ({},), timeout_s=300)
    assert time.monotonic() - start < 60  # its peer, waiting for it, is killed
    got = run_ranks(rank_behaviours.answer, 3, ({},), timeout_s=120)
    assert got == [{"rank": r, "world": 3} for r in range(3)]


def test_a_raising_check_becomes_a_fail_row_and_the_next_check_still_runs(tmp_path):
    common = _bench_import("gpu_check_common")
    verdicts = tmp_path / "verdicts.tsv"

    def broken():
        raise torch_like_oom()

    def fine():
        return "1.20x", True

    assert common.run_check(verdicts, "first", ">=1x", broken) is False
    assert common.run_check(verdicts, "second", ">=1x", fine) is True
    rows = [line.split("\t") for line in verdicts.read_text().splitlines()]
    assert rows[0][0] == "first" and rows[0][3] == "FAIL"
    assert rows[0][1].startswith("raised RuntimeError: CUDA out of memory")
    assert rows[1] == ["second", "1.20x", ">=1x", "PASS"]
    # a stage stopped outside any row: the rows it had not written become FAIL, named
    assert common.fail_unwritten(verdicts, ["first", "third"], ValueError("no ceiling")) == 1
    assert verdicts.read_text().splitlines()[-1] == "third\traised ValueError: no ceiling\t\tFAIL"


def torch_like_oom() -> RuntimeError:
    return RuntimeError("CUDA out of memory. Tried to allocate 3.75 GiB\nmore detail")


def test_flex_attention_timing_harness_runs_on_cpu():
    """The same code on a tiny packed shape, the tiled kernel standing in for FlexAttention
    (no CPU backward); without --dry-run and without CUDA it says so and exits 2."""
    script = str(REPO / "bench" / "gpu_check_flex_attention.py")
    proc = subprocess.run(
        [sys.executable, script, "--dry-run", "--iters", "1"], capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"eager FlexAttention forward vs the fp32 reference: rel err \S+", proc.stdout)
    for path in ("flex", "dense", "tiled"):
        assert re.search(rf"^\| {path} \| [\d.]+ \| [\d.]+x \| ", proc.stdout, re.M), path
    for check in _helper_checks("gpu_check_flex_attention"):
        assert f"dry run: would record {check!r}" in proc.stdout
    import torch

    if not torch.cuda.is_available():
        proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and "no CUDA device is visible" in proc.stderr
