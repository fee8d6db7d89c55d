#!/usr/bin/env bash
# One prepared device check of the HybridEP CUDA kernels on a lent H200 (< 8 minutes):
#   1. build libart_hybridep.so with nvcc (~20 s),
#   2. correctness against the torch backend, bitwise: (a) scan / permute / unpermute on one
#      GPU, (b) 2 and 4 rank processes on the same GPU exchanging through CUDA IPC (gloo group),
#   3. achieved bandwidth of permute / unpermute against a measured device-to-device copy
#      ceiling of the same byte count (bench/hybridep_kernels.py is not needed: inline below).
# Needs python3 with torch (CUDA), pytest, and nvcc on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "== build"
time timeout 120 "$PY" -c "
from hybridep import build as kb, build_hybridep_abi as abi
print('built', kb.build(abi.library_spec(), kb.BuildConfig(jobs=3)).path)"
echo "== correctness (CUDA backend vs torch backend, bitwise)"
timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/hybridep/test_cuda_backend.py
echo "== bandwidth (one GPU; ratio to a device-to-device copy of the same bytes)"
timeout 120 "$PY" - <<'PY'
import statistics, torch
from hybridep import build_hybridep_abi as abi, layout
from hybridep.backends.cuda import permute_rows, unpermute_rows

lib = abi.load_library()

def t(fn, reps=20):
    for _ in range(3):
        fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(reps):
        s.record(); fn(); e.record(); e.synchronize(); out.append(s.elapsed_time(e) / 1e3)
    return statistics.median(out)

print("| kernel | W | T | H | L | topk | GB moved | GB/s | copy GB/s | ratio |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for world, tokens, hidden, L, topk in ((8, 4096, 7168, 8, 8), (8, 8192, 2048, 16, 8)):
    g = torch.Generator().manual_seed(0)
    E = world * L
    scores = torch.rand(world, tokens, E, generator=g)
    gmap = torch.zeros_like(scores, dtype=torch.bool).scatter_(2, scores.topk(topk, 2).indices, True)
    pos = layout.expert_positions(layout.local_expert_map(gmap, 0, L), 128, None)
    m = int(pos.tokens_per_expert.sum())
    p32 = pos.positions.to(torch.int32).cuda()
    recv = torch.randn(world * tokens, hidden, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(world * tokens, L, device="cuda")
    tokens_out, _ = permute_rows(lib, recv, probs, p32, m)
    for name, fn, nbytes in (
        ("permute", lambda: permute_rows(lib, recv, probs, p32, m), 2 * m * hidden * 2),
        ("unpermute", lambda: unpermute_rows(lib, tokens_out, None, p32),
         (m + world * tokens) * hidden * 2),
    ):
        secs = t(fn)
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        copy = t(lambda: dst.copy_(src))  # reads and writes nbytes/2 each: nbytes moved
        print(f"| {name} | {world} | {tokens} | {hidden} | {L} | {topk} | {nbytes / 1e9:.2f} | "
              f"{nbytes / secs / 1e9:.0f} | {nbytes / copy / 1e9:.0f} | {copy / secs:.2f} |")
PY
