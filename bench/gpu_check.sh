#!/usr/bin/env bash
# The one GPU check for a lent H200 (README "GPU check"; docs/kernels.md). It must give a
# verdict within 8 minutes of device time, with 2 to spare, on a machine that has torch, nvcc
# and pytest but no network, no megatron-core and no nvidia-cutlass. So:
#   - what it needs beyond the image travels in the carry directory (`make gpu-carry`:
#     CUTLASS headers, pre-built kernel cache), found through ART_CUTLASS_DIR and
#     ART_PIPELINE_KERNEL_CACHE;
#   - no stage stops the script (set -uo pipefail, no -e): each runs under its own timeout,
#     inside a global budget (ART_GPU_CHECK_BUDGET_S, default 360 s), and records its status;
#   - the end of the output is one verdict table; every expected check without a result is
#     "not run". Logs, junit and the timing tables go to $OUT.
# Only tests that need torch + our packages run there (tests/hybridep, tests/art_megatron_ext/
# ops): the Megatron-dependent GPU tests (lora, moe) cannot, the image has no megatron-core.
#
# Usage: bash bench/gpu_check.sh [--dry-run]
#   --dry-run  on any machine (CPU): the same preflight, the stage plan with each command and
#              timeout, the GPU tests the stage would select (collected, not run), and the
#              verdict table with every check "not run". make test runs it.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
REPO=$PWD
DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: bash bench/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
OUT=${OUT:-${TMPDIR:-/tmp}/art-gpu-check}  # `run` sets OUT on the device machine
mkdir -p "$OUT"
TMPD=$(mktemp -d)
CARRY=${ART_GPU_CARRY_DIR:-$REPO/.gpu-carry}
export ART_GPU_CARRY_DIR=$CARRY
if [[ -z "${ART_CUTLASS_DIR:-}" && -d "$CARRY/cutlass" ]]; then
  export ART_CUTLASS_DIR=$CARRY/cutlass
fi
if [[ -z "${ART_PIPELINE_KERNEL_CACHE:-}" ]]; then
  if [[ -d "$CARRY" ]]; then
    export ART_PIPELINE_KERNEL_CACHE=$CARRY/kernel-cache
  else
    export ART_PIPELINE_KERNEL_CACHE=$TMPD/kernel-cache
  fi
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
BUDGET=${ART_GPU_CHECK_BUDGET_S:-360}
START=$(date +%s)
DEADLINE=$((START + BUDGET))
VERDICTS=$OUT/verdicts.tsv
STAGES=$OUT/stages.tsv
GPU_TEST_PATHS=(tests/hybridep tests/art_megatron_ext/ops tests/art_vllm_plugin/worker/test_staged_copies.py
                tests/art_megatron_ext/packing/test_flex_tree_attention.py)

STAGE_NAMES=(preflight build gpu-tests sync-check time-grouped-gemm time-hybridep time-flex-attention
             async-provenance)
declare -A LIMIT=([preflight]=60 [build]=200 [gpu-tests]=150 [sync-check]=45
                  [time-grouped-gemm]=60 [time-hybridep]=120 [time-flex-attention]=75
                  [async-provenance]=30)
declare -A FLOOR=([preflight]=10 [build]=30 [gpu-tests]=30 [sync-check]=15
                  [time-grouped-gemm]=20 [time-hybridep]=30 [time-flex-attention]=25
                  [async-provenance]=5)
EXPECTED=(
  "kernels build (both libraries)"
  "GPU tests (ART_REQUIRE_GPU=1, skips fail)"
  "grouped GEMM fwd (uniform)" "grouped GEMM dgrad (uniform)" "grouped GEMM wgrad (uniform)"
  "grouped GEMM fwd (skewed)" "grouped GEMM dgrad (skewed)" "grouped GEMM wgrad (skewed)"
  "HybridEP dispatch W=2 vs copy ceiling" "HybridEP combine W=2 vs copy ceiling"
  "HybridEP dispatch W=4 vs copy ceiling" "HybridEP combine W=4 vs copy ceiling"
  "HybridEP dispatch+combine W=2 vs torch all-to-all"
  "HybridEP dispatch+combine W=4 vs torch all-to-all"
  "HybridEP static-budget path: no host sync"
  "FlexAttention tree fwd+bwd agrees with fp32 reference"
  "FlexAttention tree fwd+bwd vs dense SDPA (tree mask)"
  "FlexAttention tree fwd+bwd vs tiled kernel"
  "async-scheduling provenance"
)

verdict() {  # check measured target PASS|FAIL|N/A
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$VERDICTS"
  echo "verdict: $1: $4 ($2)"
}

stage_timeout() {  # name -> seconds this stage may run (0: none left), inside the budget
  local name=$1 reserve=0 after=0 s left limit
  for s in "${STAGE_NAMES[@]}"; do
    if ((after)); then reserve=$((reserve + FLOOR[$s])); fi
    [[ $s == "$name" ]] && after=1
  done
  left=$((DEADLINE - $(date +%s) - reserve))
  limit=${LIMIT[$name]}
  ((left < limit)) && limit=$left
  ((limit < FLOOR[$name])) && limit=$((DEADLINE - $(date +%s) > FLOOR[$name] ? FLOOR[$name] : 0))
  echo "$limit"
}

record() {  # name rc seconds note
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$STAGES"
  echo "== stage $1: rc=$2 in $3 s${4:+ ($4)}"
}

run_stage() {  # name command... : run under the stage's timeout, tee into the log
  local name=$1 t t0 rc
  shift
  t=$(stage_timeout "$name")
  echo
  echo "== stage $name (timeout ${t} s): $*"
  if ((DRY)); then
    record "$name" - 0 "not run: dry run"
    return 0
  fi
  if ((t <= 0)); then
    record "$name" - 0 "not run: time budget spent"
    return 1
  fi
  t0=$(date +%s)
  timeout -k 10 "$t" "$@"
  rc=$?
  local note=""
  ((rc == 124 || rc == 137)) && note="timed out after ${t} s"
  record "$name" "$rc" $(($(date +%s) - t0)) "$note"
  return "$rc"
}

print_tables() {
  echo
  echo "== stages"
  echo "| stage | rc | seconds | note |"
  echo "| --- | --- | --- | --- |"
  while IFS=$'\t' read -r n rc s note; do echo "| $n | $rc | $s | $note |"; done <"$STAGES"
  echo
  echo "== verdicts ($(date -u +%Y-%m-%dT%H:%MZ), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo 'no GPU'), $(($(date +%s) - START)) s)"
  echo "| check | measured | target | verdict |"
  echo "| --- | --- | --- | --- |"
  local c line m t v bad=0
  for c in "${EXPECTED[@]}"; do
    line=$(awk -F'\t' -v c="$c" '$1 == c' "$VERDICTS" | tail -1)
    if [[ -n $line ]]; then
      IFS=$'\t' read -r _ m t v <<<"$line"
    else
      m="-" t="-" v="not run"
    fi
    [[ $v == PASS || $v == N/A ]] || bad=$((bad + 1))
    echo "| $c | $m | $t | $v |"
  done
  echo
  if ((DRY)); then
    echo "gpu_check: dry run done; no check ran (verdicts 'not run' by design)"
  else
    echo "gpu_check: $bad check(s) not PASS; log, junit and tables in $OUT"
  fi
  return "$bad"
}

main() {
  echo "gpu_check: $( ((DRY)) && echo 'DRY RUN ' )repo $REPO, out $OUT, budget ${BUDGET} s"
  echo "gpu_check: stages: ${STAGE_NAMES[*]}"
  echo "gpu_check: carry dir $CARRY: $([[ -d $CARRY ]] && echo found || echo 'NOT FOUND (run make gpu-carry)')"
  echo "gpu_check: ART_CUTLASS_DIR=${ART_CUTLASS_DIR:-<unset>}"
  echo "gpu_check: ART_PIPELINE_KERNEL_CACHE=$ART_PIPELINE_KERNEL_CACHE"
  timeout 10 nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used \
    --format=csv 2>&1 || echo "gpu_check: nvidia-smi unavailable"

  # build: both libraries at once, in the background, while the preflight runs
  local t_build pid_gg=0 pid_he=0 b0
  t_build=$(stage_timeout build)
  b0=$(date +%s)
  if ((!DRY)); then
    timeout -k 10 "$t_build" "$PY" bench/gpu_check_build.py grouped_gemm --jobs 8 \
      >"$TMPD/build_gg.log" 2>&1 &
    pid_gg=$!
    timeout -k 10 "$t_build" "$PY" bench/gpu_check_build.py hybridep --jobs 3 \
      >"$TMPD/build_he.log" 2>&1 &
    pid_he=$!
  fi

  echo
  echo "== stage preflight: compute capability 9.0, nvcc, torch, CUTLASS headers, carry dir"
  local p0 rc
  p0=$(date +%s)
  local t_pre
  t_pre=$(stage_timeout preflight)
  ((DRY)) && t_pre=600  # a dry run checks the logic; a loaded CPU box must not time it out
  timeout -k 5 "$t_pre" "$PY" bench/gpu_check_preflight.py
  rc=$?
  ((rc != 0)) && echo "gpu_check: PREFLIGHT FAILED ($rc required piece(s) missing); the stages run anyway and will say what broke"
  record preflight "$rc" $(($(date +%s) - p0)) "$( ((DRY && rc)) && echo 'expected on a machine without the GPU')"

  echo
  echo "== stage build (timeout ${t_build} s, concurrent): bench/gpu_check_build.py grouped_gemm & hybridep"
  if ((DRY)); then
    record build - 0 "not run: dry run"
  else
    local rc_gg rc_he
    wait "$pid_gg"; rc_gg=$?
    wait "$pid_he"; rc_he=$?
    cat "$TMPD/build_gg.log" "$TMPD/build_he.log"
    record build $((rc_gg || rc_he)) $(($(date +%s) - b0)) "grouped_gemm rc=$rc_gg, hybridep rc=$rc_he"
    verdict "kernels build (both libraries)" "grouped_gemm rc=$rc_gg, hybridep rc=$rc_he" \
      "both build or load" "$( ((rc_gg == 0 && rc_he == 0)) && echo PASS || echo FAIL)"
  fi

  # GPU tests: only the `gpu`-marked tests that need torch + our packages (no megatron-core)
  if ((DRY)); then
    echo
    echo "== gpu-tests would run (collected here, not run): pytest -m gpu ${GPU_TEST_PATHS[*]}"
    local n
    n=$(timeout 600 "$PY" -m pytest -m gpu -p no:cacheprovider --collect-only -q \
      "${GPU_TEST_PATHS[@]}" 2>&1 | tee "$TMPD/collect.log" | grep -c '::')
    grep '::' "$TMPD/collect.log" | sed 's/^/  /'
    echo "gpu-tests: $n test(s) selected by -m gpu"
    grep -E '^(ERROR|E ) ' "$TMPD/collect.log" | head -20
    if ((n == 0)) || grep -q '^ERROR' "$TMPD/collect.log"; then
      echo "gpu-tests: FAIL the GPU tests do not collect, or none carries the gpu marker"
      touch "$TMPD/dry_failed"
    fi
  fi
  run_stage gpu-tests env ART_REQUIRE_GPU=1 "$PY" -m pytest -m gpu -p no:cacheprovider -q \
    -rfEs --continue-on-collection-errors --junitxml="$OUT/gpu_tests.xml" "${GPU_TEST_PATHS[@]}" 2>&1 | tee "$TMPD/tests.log"
  rc=${PIPESTATUS[0]}
  if ((!DRY)); then
    verdict "GPU tests (ART_REQUIRE_GPU=1, skips fail)" \
      "$(grep -E '(passed|failed|error)' "$TMPD/tests.log" | tail -1 | tr -d '=' | xargs)" \
      "all pass, none skipped" "$( ((rc == 0)) && echo PASS || echo FAIL)"
  fi

  run_stage sync-check "$PY" bench/gpu_check_hybridep.py --sync-check --verdicts "$VERDICTS"
  run_stage time-grouped-gemm "$PY" bench/gpu_check_grouped_gemm.py --verdicts "$VERDICTS" \
    --report "$OUT/timing_grouped_gemm.md"
  run_stage time-hybridep "$PY" bench/gpu_check_hybridep.py --timing --verdicts "$VERDICTS" \
    --report "$OUT/timing_hybridep.md"
  # tree attention: FlexAttention (compiled, bf16) vs dense SDPA with the tree mask and the
  # tiled kernel, forward + backward (its compile is most of the stage's time)
  run_stage time-flex-attention "$PY" bench/gpu_check_flex_attention.py --verdicts "$VERDICTS" \
    --report "$OUT/timing_flex_attention.md"

  # async-scheduling provenance (serving issue): needs vLLM, which the GPU image lacks
  local why=""
  [[ -f bench/gpu_check_async_provenance.py ]] || why="bench/gpu_check_async_provenance.py does not exist"
  [[ -z $why ]] && ! "$PY" -c "import vllm" >/dev/null 2>&1 && why="vLLM is not installed in this image"
  if [[ -n $why ]]; then
    echo
    echo "== stage async-provenance: not runnable here: $why"
    record async-provenance - 0 "not runnable: $why"
    ((DRY)) || verdict "async-scheduling provenance" "not runnable here: $why" "runs on the GPU" "N/A"
  else
    run_stage async-provenance "$PY" bench/gpu_check_async_provenance.py
    rc=$?
    ((DRY)) || verdict "async-scheduling provenance" "rc=$rc" "exit 0" "$( ((rc == 0)) && echo PASS || echo FAIL)"
  fi
  print_tables
}

: >"$VERDICTS"
: >"$STAGES"
main 2>&1 | tee "$OUT/gpu_check.log"
status=${PIPESTATUS[0]}
if ((DRY)); then
  status=0
  [[ -e $TMPD/dry_failed ]] && status=1
fi
rm -rf "$TMPD"
exit $((status > 0 ? 1 : 0))
