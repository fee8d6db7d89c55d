#!/usr/bin/env bash
# Builds .venv-serve34 (Python 3.11): vLLM 0.34.0, the vLLM GPU users install now, from the CPU
# wheel built here (../shared/vllm-0.34-cpu/, never rebuilt: 45-60 min on 2 cores), and this
# project in editable mode. A second serve environment beside .venv-serve (0.32), so the serve
# suite runs on both (issue 37).
#
# Why each step (../shared/vllm-0.34-cpu/README.md):
# - 0.34 has no V1 model runner: Model Runner V2 only, which needs Triton. PyPI's Triton has no
#   CPU backend; its interpreter (TRITON_INTERPRET=1) runs vLLM's kernels once two small fixes
#   are applied to it (triton-3.9.0-interpreter.patch) and vLLM's Triton probe accepts it
#   (vllm-triton-interpret.patch). So Triton is installed into this environment (unlike the
#   0.32 one, where it is a test-only unpacked copy) and both patches are applied in place.
# - torchvision / torchaudio from PyPI are CUDA builds that break transformers beside a CPU torch;
#   the wheel requires them, so they are removed after the last install that resolves vLLM.
# - The wheel is named `vllm` with version `0.34.0+cpu`: no metadata entry to add.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-serve34}
WHEEL_DIR=$(realpath "${VLLM34_WHEEL_DIR:-../shared/vllm-0.34-cpu}")
ENV_NAME=serve34 STEP_TOTAL=6
LOG="$PWD/.cache/logs/setup-serve34.log"
mkdir -p "$(dirname "$LOG")"; : >"$LOG"
. scripts/_steps.sh
trap on_fail ERR

TORCH_CPU_VERSION=2.13.0
TRITON_VERSION=3.9.0
WHEEL="$WHEEL_DIR/vllm-0.34.0+cpu-cp311-cp311-linux_x86_64.whl"
[ -f "$WHEEL" ] || { echo "[serve34] no vLLM 0.34 CPU wheel at $WHEEL (set VLLM34_WHEEL_DIR)" >&2; exit 1; }

step "create $VENV with Python 3.11"
PY=$(scripts/find_python.sh 3.11)
rm -rf "$VENV"
run_logged "$PY" -m venv "$VENV"
run_logged "$VENV/bin/python" -m pip install -U pip wheel
done_step

PIP="$VENV/bin/python -m pip"
step "install torch==$TORCH_CPU_VERSION (CPU), the vLLM 0.34.0 CPU wheel, peft, triton==$TRITON_VERSION"
run_logged $PIP install "torch==$TORCH_CPU_VERSION"
run_logged $PIP install "$WHEEL" peft
run_logged $PIP install --no-deps "triton==$TRITON_VERSION"
done_step

step "patch Triton's interpreter and vLLM's Triton probe for TRITON_INTERPRET=1"
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# --forward: refuse a reversed or already-applied patch instead of undoing it.
run_logged patch --forward -p0 -d "$SITE" -i "$WHEEL_DIR/triton-3.9.0-interpreter.patch"
run_logged patch --forward -p0 -d "$SITE" -i "$WHEEL_DIR/vllm-triton-interpret.patch"
done_step

step "install art-pipeline (editable) with extras vllm,dev"
run_logged $PIP install -e ".[vllm,dev]"
done_step

# Last: the wheel's metadata asks for torchvision / torchaudio / torchcodec, so every pip
# install that resolves vLLM's requirements (the project's, above) brings them back.
install_nixl "$VENV"  # scripts/_steps.sh: the DP=2 files run on 0.34 over art_nixl

step "remove CUDA companions that break a CPU torch (torchvision, torchaudio, torchcodec)"
run_logged $PIP uninstall -y torchvision torchaudio torchcodec
done_step
echo "[serve34] ready: $VENV ($(du -sh "$VENV" | cut -f1))"
