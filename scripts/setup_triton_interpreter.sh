#!/usr/bin/env bash
# Test set-up for Model Runner V2 on the CPU build (../shared/docs/vllm-on-cpu.md, "Model Runner
# V2 on CPU"): Triton unpacked into .cache/triton (no dependencies; about 1 GB unpacked), and a
# `.pth` hook in .venv-serve that puts it and the test-only `cpu` backend registration
# (tests/support/triton_cpu) at the front of sys.path, but only in a process whose environment
# has ART_TEST_TRITON_PATHS (tests/support/model_runner.py sets it for the serve suite's servers).
# Without that variable the environment is what CPU users get: no Triton, the V1 model runner.
# Why not PYTHONPATH: the serve suite also starts .venv-train processes (Python 3.12), which
# must not see a Triton built for 3.11.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-serve}
ENV_NAME=triton STEP_TOTAL=2
LOG="$PWD/.cache/logs/setup-triton.log"
mkdir -p "$(dirname "$LOG")"; : >"$LOG"
. scripts/_steps.sh
trap on_fail ERR

TRITON_VERSION=3.9.0
TARGET=.cache/triton

step "unpack triton==$TRITON_VERSION (no dependencies) into $TARGET"
if [ ! -f "$TARGET/.ready-$TRITON_VERSION" ]; then
  rm -rf "$TARGET"
  run_logged "$VENV/bin/python" -m pip install --no-deps --target "$TARGET" "triton==$TRITON_VERSION"
  touch "$TARGET/.ready-$TRITON_VERSION"
fi
done_step

step "add the ART_TEST_TRITON_PATHS hook to $VENV"
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cat >"$SITE/art_test_triton_paths.pth" <<'PTH'
import os, sys; sys.path[:0] = [p for p in os.environ.get("ART_TEST_TRITON_PATHS", "").split(os.pathsep) if p and p not in sys.path]
PTH
done_step
