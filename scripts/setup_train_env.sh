#!/usr/bin/env bash
# Builds .venv-train (Python 3.12): megatron-core 0.19 (its CUDA torch build also runs on
# CPU), nvidia-cutlass for the CUTLASS headers, and this project in editable mode.
# Transformer Engine is never installed here (it cannot build or run without a GPU; the
# `gpu` extra is for GPU machines).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-train}
ENV_NAME=train STEP_TOTAL=4
LOG="$PWD/.cache/logs/setup-train.log"
mkdir -p "$(dirname "$LOG")"; : >"$LOG"
. scripts/_steps.sh
trap on_fail ERR

step "create $VENV with Python 3.12"
PY=$(scripts/find_python.sh 3.12)
rm -rf "$VENV"
run_logged "$PY" -m venv "$VENV"
run_logged "$VENV/bin/python" -m pip install -U pip wheel
done_step

step "install megatron-core==0.19.* and nvidia-cutlass (pulls torch 2.14, about 3 GB)"
run_logged "$VENV/bin/python" -m pip install "megatron-core>=0.19,<0.20" "nvidia-cutlass>=4.2"
done_step

step "install art-pipeline (editable) with extras megatron,dev"
run_logged "$VENV/bin/python" -m pip install -e ".[megatron,dev]"
done_step
install_nixl "$VENV"  # scripts/_steps.sh
echo "[train] ready: $VENV ($(du -sh "$VENV" | cut -f1))"
