"""Preflight of bench/gpu_check.sh: is every piece the GPU check needs on this machine?

Prints one line per check, `preflight: <name>: OK <detail>` or `preflight: <name>: FAIL <why>`,
and exits with the number of failed checks. Why one Python process for all of them: importing
torch costs seconds of a 15-minute device lease; every check shares that one import.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, not installed

REQUIRED_CAPABILITY = (9, 0)


def _torch() -> str:
    import torch

    return f"torch {torch.__version__} (CUDA {torch.version.cuda}), python {sys.version.split()[0]}"


def _gpu() -> str:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is visible (torch.cuda.is_available() is False)")
    cap = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    if cap != REQUIRED_CAPABILITY:
        raise RuntimeError(f"{name} has compute capability {cap}, the kernels need 9.0 (sm_90a)")
    props = torch.cuda.get_device_properties(0)
    return f"{name}, compute capability 9.0, {props.multi_processor_count} SMs"


def _nvcc() -> str:
    exe = shutil.which("nvcc")
    if exe is None:
        raise RuntimeError("nvcc is not on PATH (the kernels are compiled on the machine)")
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True)
    return f"{exe}: {out.stdout.strip().splitlines()[-1]}"


def _carry() -> str:
    carry = Path(os.environ.get("ART_GPU_CARRY_DIR", ".gpu-carry"))
    if not carry.is_dir():
        raise RuntimeError(f"carry directory {carry} not found: run `make gpu-carry` first")
    parts = sorted(p.name for p in carry.iterdir())
    return f"{carry} ({', '.join(parts)})"


def _cutlass() -> str:
    from art_megatron_ext.ops import cutlass_grouped_gemm as cg

    try:
        found = cg.find_cutlass()
    except cg.CutlassHeadersMissing as exc:
        raise RuntimeError(str(exc)) from exc
    return f"CUTLASS {found.version} from {found.origin} at {found.root}"


def _kernel_cache() -> str:
    from art_megatron_ext.ops import cutlass_grouped_gemm as cg
    from hybridep import build as kb
    from hybridep import build_hybridep_abi as abi

    cache = kb.default_cache_dir()
    entries = sorted(p.name for p in cache.glob("*-*") if p.is_dir()) if cache.is_dir() else []
    # valid for THESE sources, headers and nvcc release, or the build stage recompiles
    # (1-2 minutes of device time): say which, before any stage runs
    stale = []
    for name, make_spec in (
        ("art_hybridep", abi.library_spec),
        ("art_grouped_gemm", cg.library_spec),
    ):
        try:
            if kb.find_cached(make_spec()) is None:
                stale.append(name)
        except Exception as exc:  # e.g. CUTLASS headers missing: the spec cannot be keyed
            stale.append(f"{name} ({type(exc).__name__})")
    if stale:
        raise RuntimeError(
            f"{cache} ({len(entries)} entries) has no valid entry for {stale}: the build "
            "stage compiles them on the device (run `make gpu-carry` after changing csrc/)"
        )
    return f"{cache}: both libraries valid for these sources ({entries})"


def _pytest() -> str:
    import pytest

    return f"pytest {pytest.__version__}"


def _vllm() -> str:
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("vLLM is not installed (the async-provenance check cannot run here)")
    return "vLLM importable"


CHECKS: list[tuple[str, Callable[[], str], bool]] = [
    # name, check, required (an optional check reports but does not count as a failure)
    ("torch", _torch, True),
    ("gpu", _gpu, True),
    ("nvcc", _nvcc, True),
    ("carry dir", _carry, True),
    ("cutlass headers", _cutlass, True),
    ("kernel cache", _kernel_cache, False),
    ("pytest", _pytest, True),
    ("vllm", _vllm, False),
]


def main() -> int:
    failed = 0
    for name, check, required in CHECKS:
        try:
            print(f"preflight: {name}: OK {check()}", flush=True)
        except Exception as exc:  # every failure is reported, none stops the others
            tag = "FAIL" if required else "ABSENT"
            failed += int(required)
            print(f"preflight: {name}: {tag} {type(exc).__name__}: {exc}", flush=True)
    print(f"preflight: {failed} required check(s) failed", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
