"""Build (or take from the cache) one kernel library for bench/gpu_check.sh.

    python bench/gpu_check_build.py hybridep|grouped_gemm [--jobs N]

A valid cache entry (a carried one included: `make gpu-carry` pre-builds both libraries with
the same nvcc major) is used only if it also loads with `dlopen` on this machine; a library
built elsewhere that does not load (other system libraries) is rebuilt here. Prints
`build: <lib>: OK <how> <path>` or `build: <lib>: FAIL <why>`; exit status 0 only on OK.
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hybridep import build as kb


def spec_of(lib: str) -> kb.KernelLibrarySpec:
    if lib == "hybridep":
        from hybridep import build_hybridep_abi as abi

        return abi.library_spec()
    from art_megatron_ext.ops import cutlass_grouped_gemm as cg

    return cg.library_spec()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lib", choices=("hybridep", "grouped_gemm"))
    parser.add_argument("--jobs", type=int, default=4)
    args = parser.parse_args()
    t0 = time.monotonic()
    try:
        spec = spec_of(args.lib)
        config = kb.BuildConfig(jobs=args.jobs)
        how = "cached"
        hit = kb.find_cached(spec, config)
        if hit is not None:
            try:
                ctypes.CDLL(str(hit.path))
            except OSError as exc:
                print(f"build: {args.lib}: cached library does not load here ({exc}); rebuilding")
                shutil.rmtree(hit.path.parent)
                hit = None
        if hit is None:
            how = "built"
            hit = kb.build(spec, config)
            ctypes.CDLL(str(hit.path))
    except Exception as exc:  # reported as this stage's failure; the script goes on
        print(f"build: {args.lib}: FAIL {type(exc).__name__}: {exc}")
        return 1
    print(f"build: {args.lib}: OK {how} in {time.monotonic() - t0:.1f} s {hit.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
