# Shared helpers for the set-up scripts: numbered progress lines and a failure message that
# names the step that broke, so a cold install of several minutes is never silent.
STEP_N=0
STEP_TOTAL=${STEP_TOTAL:-0}
ENV_NAME=${ENV_NAME:-env}
step() {
  STEP_N=$((STEP_N + 1))
  CURRENT_STEP="$1"
  printf '[%s %d/%d] %s\n' "$ENV_NAME" "$STEP_N" "$STEP_TOTAL" "$1"
  STEP_T0=$(date +%s)
}
done_step() {
  printf '[%s %d/%d] done in %ss\n' "$ENV_NAME" "$STEP_N" "$STEP_TOTAL" "$(( $(date +%s) - STEP_T0 ))"
}
on_fail() {
  local rc=$?
  printf '\n[%s] FAILED at step %d/%d: %s (exit %d). Log: %s\n' \
    "$ENV_NAME" "$STEP_N" "$STEP_TOTAL" "${CURRENT_STEP:-start}" "$rc" "${LOG:-stdout}" >&2
  if [ -n "${LOG:-}" ] && [ -f "$LOG" ]; then
    echo "---- last 30 lines of $LOG ----" >&2; tail -n 30 "$LOG" >&2
  fi
  exit "$rc"
}
run_logged() {  # run a command, appending its output to $LOG; the progress line stays short
  "$@" >>"$LOG" 2>&1
}
has_cuda_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '
}

# NIXL (the art_nixl weight transfer) into venv $1, without its declared dependencies: the
# `nixl` meta package requires both CUDA wheels and an unpinned torch. The backend wheel
# follows torch's CUDA major (a CPU torch: nixl-cu12, whose UCX backend moves host memory).
NIXL_VERSION=1.5.1
install_nixl() {
  local venv=$1 cuda
  step "install nixl==$NIXL_VERSION with the backend wheel matching torch (--no-deps)"
  cuda=$("$venv/bin/python" -c "import torch; print((torch.version.cuda or '12').split('.')[0])")
  run_logged "$venv/bin/python" -m pip install --no-deps "nixl==$NIXL_VERSION" "nixl-cu$cuda==$NIXL_VERSION"
  run_logged "$venv/bin/python" -c "from nixl._api import nixl_agent"
  done_step
}
