"""bench/gpu_check.sh checks its own logic on CPU (`--dry-run`), and its helpers' harnesses run.

The real run needs the lent H200; what can go wrong before the first kernel launches (a stage
list that stops early, a carry dir not found, a verdict row nobody writes, a harness bug in
the multi-rank timing) is checked here, so the 15 minutes of device time go to the kernels.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_check.sh"
STAGES = ("preflight", "build", "gpu-tests", "sync-check", "time-grouped-gemm",
          "time-hybridep", "time-flex-attention", "async-provenance")  # fmt: skip


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
    text = dry_run[0].stdout
    selected = int(re.search(r"gpu-tests: (\d+) test\(s\) selected by -m gpu", text).group(1))
    assert selected > 0 and "gpu-tests: FAIL" not in text


def test_dry_run_prints_every_verdict_not_run(dry_run):
    text = dry_run[0].stdout
    table = text[text.index("== verdicts") :]
    checks = [
        "kernels build (both libraries)",
        "GPU tests (ART_REQUIRE_GPU=1, skips fail)",
        *_helper_checks("gpu_check_grouped_gemm"),
        *_helper_checks("gpu_check_hybridep"),
        *_helper_checks("gpu_check_flex_attention"),
        "async-scheduling provenance",
    ]
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
        assert f"dry run: would record {check!r}" in proc.stdout
    assert proc.stdout.count("| skewed |") == 6 and proc.stdout.count("| uniform |") == 6


def test_hybridep_timing_harness_runs_on_cpu_with_two_ranks():
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check_hybridep.py"), "--dry-run"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^\| 2 \| dispatch \| ", proc.stdout, re.M)
    assert re.search(r"^\| 2 \| dispatch\+combine \| ", proc.stdout, re.M)
    assert "would record 'HybridEP dispatch+combine W=2 vs torch all-to-all'" in proc.stdout


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
