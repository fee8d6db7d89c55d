#!/usr/bin/env bash
# Prepares the carry directory for bench/gpu_check.sh (`make gpu-carry`): what the lent GPU
# machine needs beyond its image (torch, nvcc, pytest; no network, no nvidia-cutlass, no
# megatron-core). The parts travel compressed: the working tree and the carry together must
# stay under 64 MiB (checked at the end); bench/gpu_check_unpack.py unpacks them there in
# about a second and prints the `export` lines.
#   <dir>/cutlass.tar.xz        CUTLASS headers (`cutlass/include`, `cutlass/tools/util/include`,
#       ~28 MB unpacked) from the installed nvidia-cutlass -> ART_CUTLASS_DIR
#   <dir>/megatron-core.tar.xz  the installed `megatron` package and its dist-info (no
#       __pycache__, no tests) -> PYTHONPATH; it needs torch, numpy and packaging from the
#       image (MANIFEST.txt says which versions)
#   <dir>/kernel-cache   both kernel libraries pre-built here (skip: GPU_CARRY_PREBUILD=0; an
#       existing cache is then kept as it is); the check uses an entry only if it is valid
#       there (digest, header bytes, same nvcc) AND dlopens there, else it rebuilds on the
#       device (about a minute of its time). Built against the unpacked archive, so it is the
#       same header bytes the device sees.
#   <dir>/MANIFEST.txt   versions, sizes, what the image must provide
# The directory is ignored through .git/info/exclude and travels with `run`'s carry list.
# Usage: bash scripts/gpu_carry.sh [DIR]   (default .gpu-carry; PYTHON= the training env's)
# GPU_CARRY_XZ: the compressor command (default `xz -T0 -6`; the unpacker detects the
# compression from the content, so `gzip -6` also works, under the same names).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.gpu-carry}
PY=${PYTHON:-.venv-train/bin/python}
XZ=${GPU_CARRY_XZ:-xz -T0 -6}
LIMIT_MB=64
mkdir -p "$DIR"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

pack() {  # archive -C dir paths... : tar (no caches, no tests) through $XZ, then rename
  local out=$DIR/$1
  shift
  tar --exclude=__pycache__ --exclude='*.pyc' --exclude=tests "$@" -cf - | $XZ >"$out.part"
  mv "$out.part" "$out"
}

root=$("$PY" -c "from art_megatron_ext.ops.cutlass_grouped_gemm import find_cutlass; print(find_cutlass().root)")
echo "[gpu-carry] CUTLASS headers from $root"
rm -rf "$DIR/cutlass"  # the uncompressed copy earlier versions of this script carried
pack cutlass.tar.xz -C "$root" --transform='flags=r;s,^,cutlass/,' include tools/util/include

site=$("$PY" -c "import importlib.util as u, pathlib as p; print(p.Path(u.find_spec('megatron.core').origin).parents[2])")
mc_version=$("$PY" -c "import importlib.metadata as m; print(m.version('megatron-core'))")
dist=$(cd "$site" && ls -d megatron_core-*.dist-info 2>/dev/null | head -1 || true)
echo "[gpu-carry] megatron-core $mc_version from $site/megatron${dist:+ (+ $dist)}"
pack megatron-core.tar.xz -C "$site" megatron ${dist:+"$dist"}

# unpack both the way the device does, and check them from there
"$PY" bench/gpu_check_unpack.py "$DIR" "$WORK/unpacked" >"$WORK/env.sh"
# shellcheck disable=SC1091
source "$WORK/env.sh"
"$PY" -c "
import importlib.util, os
from art_megatron_ext.ops.cutlass_grouped_gemm import find_cutlass
c = find_cutlass(); print(f'[gpu-carry] carried CUTLASS {c.version} found through {c.origin}')
origin = importlib.util.find_spec('megatron.core').origin
assert origin.startswith(os.environ['PYTHONPATH'].split(':')[0]), origin
print(f'[gpu-carry] carried megatron.core found at {origin}')"

if [[ "${GPU_CARRY_PREBUILD:-1}" != 0 ]]; then
  echo "[gpu-carry] pre-building both kernel libraries into $DIR/kernel-cache (minutes here)"
  # ART_CUTLASS_DIR (from env.sh above) is the unpacked copy
  ART_PIPELINE_KERNEL_CACHE=$(cd "$DIR" && pwd)/kernel-cache
  export ART_PIPELINE_KERNEL_CACHE
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
elif [[ -d $DIR/kernel-cache ]]; then
  echo "[gpu-carry] GPU_CARRY_PREBUILD=0: the existing $DIR/kernel-cache is kept as it is"
fi

if [[ $DIR != /* && -d .git/info ]]; then  # inside the checkout: keep git (and `run`) quiet
  grep -qsxF "/$DIR/" .git/info/exclude || echo "/$DIR/" >>.git/info/exclude
fi
{
  echo "prepared $(date -u +%Y-%m-%dT%H:%MZ) on $(hostname)"
  nvcc --version 2>/dev/null | tail -1 || echo "nvcc: absent"
  echo "unpack on the device: eval \"\$(python bench/gpu_check_unpack.py $DIR DEST)\""
  echo "megatron-core $mc_version (Requires-Python >= 3.12; its sources also compile on 3.11),"
  echo "  needs from the image: $("$PY" -c "
import importlib.metadata as m
reqs = [r for r in m.requires('megatron-core') or [] if 'extra ==' not in r]
have = '; '.join(f'{n} {m.version(n)}' for n in ('torch', 'numpy', 'packaging'))
print(', '.join(reqs) + f' (built here against {have}); no transformer_engine, no apex')")"
  echo "carried parts (compressed / unpacked KiB):"
  for f in "$DIR"/*.tar.*; do
    echo "  $(basename "$f") $(du -k "$f" | cut -f1) / $(tar -tvf "$f" | awk '{s += $3} END {print int(s / 1024)}')"
  done
  [[ -d $DIR/kernel-cache ]] && echo "  kernel-cache $(du -sk "$DIR/kernel-cache" | cut -f1)"
} >"$DIR/MANIFEST.txt"
cat "$DIR/MANIFEST.txt"
tree_kb=$( (git ls-files -z --cached --others --exclude-standard | du -ck --files0-from=- | tail -1 | cut -f1) 2>/dev/null || echo 0)
carry_kb=$(du -sk "$DIR" | cut -f1)
total_kb=$((tree_kb + carry_kb))
echo "[gpu-carry] working tree ${tree_kb} KiB + carry ${carry_kb} KiB = $((total_kb / 1024)) MiB (limit ${LIMIT_MB} MiB)"
if ((total_kb >= LIMIT_MB * 1024)); then
  echo "[gpu-carry] too large to travel: prune the working tree or GPU_CARRY_PREBUILD=0" >&2
  exit 1
fi
echo "[gpu-carry] ready: run bench/gpu_check.sh with carry [\"$DIR\"]"
