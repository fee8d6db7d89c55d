#!/usr/bin/env bash
# One prepared device check of the CUTLASS grouped GEMM on a lent H200 (< 8 minutes):
#   1. build libart_grouped_gemm.so with nvcc (4 translation units in parallel, ~1-2 min),
#   2. correctness against torch._grouped_mm and a float64 loop (pytest, GPU tests),
#   3. TFLOP/s of fwd/dgrad/wgrad vs torch._grouped_mm and the measured bf16 ceiling.
# Needs python3 with torch (CUDA), nvidia-cutlass (headers), pytest, and nvcc on PATH.
# Usage: bash bench/gpu_check_grouped_gemm.sh   (run from the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv || true
echo "== build"
time timeout 300 "$PY" - <<'PY'
from hybridep import build as kb
from art_megatron_ext.ops import cutlass_grouped_gemm as cg
built = kb.build(cg.library_spec(), kb.BuildConfig(jobs=4))
print("built", built.path)
PY
echo "== correctness (CUTLASS vs torch._grouped_mm / float64 loop)"
timeout 180 "$PY" -m pytest -q -p no:cacheprovider tests/art_megatron_ext/ops/test_grouped_gemm_cutlass.py
echo "== timing"
timeout 200 "$PY" bench/grouped_gemm.py --gpu --reps 20
