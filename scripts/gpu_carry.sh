#!/usr/bin/env bash
# Prepares the carry directory for bench/gpu_check.sh (`make gpu-carry`): what the lent GPU
# machine needs beyond its image (torch, nvcc, pytest; no network, no nvidia-cutlass).
#   <dir>/cutlass/include, <dir>/cutlass/tools/util/include  CUTLASS headers (~28 MB) from the
#       installed nvidia-cutlass; the check finds them through ART_CUTLASS_DIR
#   <dir>/kernel-cache   both kernel libraries pre-built here (skip: GPU_CARRY_PREBUILD=0);
#       the check uses an entry only if it is valid there (digest, headers, same nvcc) AND
#       dlopens there, else it rebuilds on the device (about a minute of its time)
#   <dir>/MANIFEST.txt   versions and sizes
# The directory is ignored through .git/info/exclude and travels with `run`'s carry list;
# the whole working tree must stay under 64 MiB (checked at the end).
# Usage: bash scripts/gpu_carry.sh [DIR]   (default .gpu-carry; PYTHON= the training env's)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.gpu-carry}
PY=${PYTHON:-.venv-train/bin/python}
LIMIT_MB=64

root=$("$PY" -c "from art_megatron_ext.ops.cutlass_grouped_gemm import find_cutlass; print(find_cutlass().root)")
echo "[gpu-carry] CUTLASS headers from $root"
rm -rf "$DIR/cutlass"
mkdir -p "$DIR/cutlass/tools/util"
cp -r "$root/include" "$DIR/cutlass/include"
cp -r "$root/tools/util/include" "$DIR/cutlass/tools/util/include"
ART_CUTLASS_DIR=$PWD/$DIR/cutlass "$PY" -c "
from art_megatron_ext.ops.cutlass_grouped_gemm import find_cutlass
c = find_cutlass(); print(f'[gpu-carry] carried CUTLASS {c.version} found through {c.origin}')"

if [[ "${GPU_CARRY_PREBUILD:-1}" != 0 ]]; then
  echo "[gpu-carry] pre-building both kernel libraries into $DIR/kernel-cache (minutes here)"
  export ART_CUTLASS_DIR=$PWD/$DIR/cutlass ART_PIPELINE_KERNEL_CACHE=$PWD/$DIR/kernel-cache
  "$PY" bench/gpu_check_build.py hybridep --jobs 2
  "$PY" bench/gpu_check_build.py grouped_gemm --jobs "${GPU_CARRY_JOBS:-2}"
  # keep only the valid current entries: stale ones would only cost carry space
  "$PY" - "$DIR/kernel-cache" <<'PY'
import shutil, sys
from pathlib import Path
from hybridep import build as kb
from hybridep import build_hybridep_abi as abi
from art_megatron_ext.ops import cutlass_grouped_gemm as cg
cache = Path(sys.argv[1])
keep = {kb.entry_dir(spec, kb.BuildConfig(cache_dir=cache)).name
        for spec in (abi.library_spec(), cg.library_spec())}
for p in cache.iterdir():
    if p.name not in keep and p.name.removesuffix(".lock") not in keep:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
        print(f"[gpu-carry] dropped stale {p.name}")
PY
fi

if [[ $DIR != /* && -d .git/info ]]; then  # inside the checkout: keep git (and `run`) quiet
  grep -qsxF "/$DIR/" .git/info/exclude || echo "/$DIR/" >>.git/info/exclude
fi
{
  echo "prepared $(date -u +%Y-%m-%dT%H:%MZ) on $(hostname)"
  nvcc --version 2>/dev/null | tail -1 || echo "nvcc: absent"
  du -sh "$DIR"/* 2>/dev/null || true
} >"$DIR/MANIFEST.txt"
cat "$DIR/MANIFEST.txt"
tree_kb=$( (git ls-files -z --cached --others --exclude-standard | du -ck --files0-from=- | tail -1 | cut -f1) 2>/dev/null || echo 0)
carry_kb=$(du -sk "$DIR" | cut -f1)
total_mb=$(((tree_kb + carry_kb) / 1024))
echo "[gpu-carry] working tree ${tree_kb} KiB + carry ${carry_kb} KiB = ${total_mb} MiB (limit ${LIMIT_MB} MiB)"
if ((total_mb >= LIMIT_MB)); then
  echo "[gpu-carry] too large to travel: prune the working tree or GPU_CARRY_PREBUILD=0" >&2
  exit 1
fi
echo "[gpu-carry] ready: run bench/gpu_check.sh with carry [\"$DIR\"]"
