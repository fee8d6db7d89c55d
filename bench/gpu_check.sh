#!/usr/bin/env bash
# The one GPU check for a lent H200 (README "GPU check"; docs/gpu-check.md). It must give a
# verdict within 6 minutes of device time, so a second try fits, on a machine that has torch,
# nvcc and pytest but no network, no megatron-core and no nvidia-cutlass. So:
#   - what it needs beyond the image travels compressed in the carry directory
#     (`make gpu-carry`: megatron-core, CUTLASS headers, pre-built kernel cache) and is
#     unpacked first (bench/gpu_check_unpack.py), found through PYTHONPATH, ART_CUTLASS_DIR
#     and ART_PIPELINE_KERNEL_CACHE;
#   - no stage stops the script (set -uo pipefail, no -e): each runs under its own timeout,
#     inside a global budget (ART_GPU_CHECK_BUDGET_S, default 360 s) that keeps a floor of
#     time for every later stage, and prints its elapsed time;
#   - every check writes its row the moment it ends (an exception is a FAIL row naming it,
#     a dead or stuck rank is named within its deadline), so a stage cut short keeps the rows
#     it finished; the end of the output is one verdict table where a check without a row is
#     "not run". Logs, junit and the timing tables go to $OUT.
#
# Usage: bash bench/gpu_check.sh [--dry-run]
#   --dry-run  on any machine (CPU): the preflight, the plan (every verdict row with its stage,
#              oracle and time budget), each stage's command and timeout, the GPU test files
#              and tests the stages would select (collected, not run), and the verdict table
#              with every check "not run". make test runs it (tests/train_env/test_gpu_check.py,
#              which also runs each stage's harness with --dry-run on CPU).
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
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
UNPACK_LOG=$TMPD/unpack.log
if [[ -d $CARRY ]]; then  # megatron-core onto PYTHONPATH, CUTLASS into ART_CUTLASS_DIR
  eval "$("$PY" bench/gpu_check_unpack.py "$CARRY" "$TMPD/carry" 2>"$UNPACK_LOG")"
fi
if [[ -z "${ART_CUTLASS_DIR:-}" && -d "$CARRY/cutlass" ]]; then  # an uncompressed carry
  export ART_CUTLASS_DIR=$CARRY/cutlass
fi
if [[ -z "${ART_PIPELINE_KERNEL_CACHE:-}" ]]; then
  if [[ -d "$CARRY" ]]; then
    export ART_PIPELINE_KERNEL_CACHE=$CARRY/kernel-cache
  else
    export ART_PIPELINE_KERNEL_CACHE=$TMPD/kernel-cache
  fi
fi
BUDGET=${ART_GPU_CHECK_BUDGET_S:-360}
START=$(date +%s)
DEADLINE=$((START + BUDGET))
VERDICTS=$OUT/verdicts.tsv
STAGES=$OUT/stages.tsv
# GPU tests: the files under these paths that carry the `gpu` marker (a file is selected, not
# a directory: a CPU-only module may import what the image lacks, e.g. hypothesis)
GPU_TEST_PATHS=(tests/hybridep tests/art_megatron_ext/ops tests/art_vllm_plugin/worker/test_staged_copies.py
                tests/art_megatron_ext/packing/test_flex_tree_attention.py)
# the Megatron-side twins: need the carried megatron-core (no transformer_engine on the image)
MEGATRON_TEST_PATHS=(tests/art_megatron_ext/lora/test_no_host_syncs_gpu.py
                     tests/art_megatron_ext/lora/test_lora_local_spec_gpu.py
                     tests/art_megatron_ext/lora/test_grouped_lora_cutlass_gpu.py
                     tests/art_megatron_ext/moe/test_hybridep_flex_gpu.py
                     tests/art_megatron_ext/packing/test_tree_attention_megatron_gpu.py
                     tests/art_megatron_ext/weights/test_hf_stream_gpu.py
                     tests/art_megatron_ext/weights/test_kept_version.py
                     tests/art_megatron_ext/weights/test_buckets.py)
# the Pipeline RL example's trainer on recorded rollouts (no vLLM): its cuda case, with the
# carried megatron-core, NCCL and no CPU stand-in
EXAMPLE_TEST_PATHS=(tests/examples/test_trainer_on_device.py)

STAGE_NAMES=(preflight build gpu-tests megatron-gpu-tests example-trainer hybridep-ranks
             time-grouped-gemm time-hybridep time-flex-attention async-provenance)
declare -A LIMIT=([preflight]=60 [build]=200 [gpu-tests]=120 [megatron-gpu-tests]=150
                  [example-trainer]=120 [hybridep-ranks]=60 [time-grouped-gemm]=60
                  [time-hybridep]=60 [time-flex-attention]=75 [async-provenance]=30)
# example-trainer: importing Megatron and compiling FlexAttention's forward and backward are
# most of its time (not yet measured on a GPU)
declare -A FLOOR=([preflight]=10 [build]=30 [gpu-tests]=30 [megatron-gpu-tests]=20
                  [example-trainer]=40 [hybridep-ranks]=15 [time-grouped-gemm]=20
                  [time-hybridep]=20 [time-flex-attention]=25 [async-provenance]=5)
# Every verdict row: check <TAB> stage <TAB> oracle (what PASS means). The helpers write the
# same check names (their CHECKS lists; tests/train_env/test_gpu_check.py holds them equal).
GG="every group elementwise within tol of an fp32 reference, >=1.10x torch._grouped_mm, >=60% of the bf16 matmul rate"
HE_COPY="kernels of all W ranks alone (one process): >=70% of the device-to-device copy rate, output bitwise = reference"
HE_TORCH=">=1.0x the torch path on the same routing (gather + one all-to-all-sized copy + fp32 index_add)"
EXPECTED=()
row() { EXPECTED+=("$1"$'\t'"$2"$'\t'"$3"); }  # check stage oracle
row 'kernels build (both libraries)' build 'both libraries load from the carried cache or build'
row 'GPU tests (ART_REQUIRE_GPU=1, skips fail)' gpu-tests 'pytest -m gpu on the selected files: all pass, none skipped'
row 'Megatron GPU twins (carried megatron-core)' megatron-gpu-tests 'pytest -m gpu on the Megatron twins: all pass, none skipped'
row 'Pipeline RL example trainer on CUDA (recorded rollouts)' example-trainer 'pytest -m gpu tests/examples/test_trainer_on_device.py: NCCL, no stand-ins; loss finite and falling; parameters, grad buffers, logprobs, token weight on the GPU'
row 'grouped GEMM fwd (uniform)' time-grouped-gemm "$GG"
row 'grouped GEMM dgrad (uniform)' time-grouped-gemm "$GG"
row 'grouped GEMM wgrad (uniform)' time-grouped-gemm "$GG"
row 'grouped GEMM fwd (skewed)' time-grouped-gemm "$GG"
row 'grouped GEMM dgrad (skewed)' time-grouped-gemm "$GG"
row 'grouped GEMM wgrad (skewed)' time-grouped-gemm "$GG; empty groups' dW exactly 0"
row 'HybridEP dispatch W=2 kernels alone vs copy ceiling' time-hybridep "$HE_COPY"
row 'HybridEP combine W=2 kernels alone vs copy ceiling' time-hybridep "$HE_COPY"
row 'HybridEP dispatch W=4 kernels alone vs copy ceiling' time-hybridep "$HE_COPY"
row 'HybridEP combine W=4 kernels alone vs copy ceiling' time-hybridep "$HE_COPY"
row 'HybridEP dispatch W=8 kernels alone vs copy ceiling' time-hybridep "$HE_COPY"
row 'HybridEP combine W=8 kernels alone vs copy ceiling' time-hybridep "$HE_COPY"
row 'HybridEP dispatch+combine W=2 vs torch path' time-hybridep "$HE_TORCH"
row 'HybridEP dispatch+combine W=4 vs torch path' time-hybridep "$HE_TORCH"
row 'HybridEP dispatch+combine W=8 vs torch path' time-hybridep "$HE_TORCH"
row 'HybridEP H=12 (unaligned rows): dispatch+combine bitwise' time-hybridep 'the one-element path: bitwise = reference'
row 'HybridEP T=16384 H=7168 W=4: dispatch+combine bitwise' time-hybridep 'bitwise = reference at large T'
row 'HybridEP W=2 processes: fused paths bitwise = torch backend' hybridep-ranks 'CUDA IPC + device barriers, fused dispatch+permute / unpermute+combine bitwise = torch backend (time reported, not judged)'
row 'HybridEP W=4 processes: fused paths bitwise = torch backend' hybridep-ranks 'the same at W=4'
row 'HybridEP static-budget path: no host sync' hybridep-ranks 'no host sync under set_sync_debug_mode("error"); bitwise = torch backend'
row 'FlexAttention tree fwd+bwd agrees with fp32 reference' time-flex-attention 'rel err <= 2x dense SDPA bf16 error, at most 2e-2'
row 'FlexAttention tree fwd+bwd vs dense SDPA (tree mask)' time-flex-attention '>=1.0x dense SDPA with the tree mask, and agrees'
row 'FlexAttention tree fwd+bwd vs tiled kernel' time-flex-attention '>=2.0x the tiled kernel, and agrees'
row 'async-scheduling provenance' async-provenance 'needs vLLM (absent in the image): N/A there'

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
  echo "== stage $name (timeout ${t} s, t+$(($(date +%s) - START)) s): $*"
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

print_plan() {  # every verdict row, the stage that writes it, its oracle and the stage's time
  echo
  echo "== plan: every verdict row (budget ${BUDGET} s in all; a stage gets at most its limit"
  echo "   and at least its floor, the floors of the stages after it kept back)"
  echo "| check | stage | limit s | floor s | oracle (PASS when) |"
  echo "| --- | --- | --- | --- | --- |"
  local entry c st o
  for entry in "${EXPECTED[@]}"; do
    IFS=$'\t' read -r c st o <<<"$entry"
    echo "| $c | $st | ${LIMIT[$st]} | ${FLOOR[$st]} | $o |"
  done
}

gpu_files() {  # paths... -> the test files among them that carry the gpu marker, one a line
  # (directly, or through the shared cpu/cuda device parameter, tests/support/devices.py)
  grep -rlE --include='test_*.py' 'pytest\.mark\.gpu\b|mark\.gpu\b|cpu_and_cuda\(\)' "$@" \
    2>/dev/null | sort
}

collect_dry() {  # label files... : what `pytest -m gpu` would run there (collected, not run)
  local label=$1 n bad=0
  shift
  echo
  echo "== $label would run (collected here, not run): pytest -m gpu $*"
  n=$(timeout 600 "$PY" -m pytest -m gpu -p no:cacheprovider --collect-only -q "$@" 2>&1 |
    tee "$TMPD/collect.log" | grep -c '::')
  grep '::' "$TMPD/collect.log" | sed 's/^/  /'
  echo "$label: $n test(s) selected by -m gpu"
  grep -E '^(ERROR|E ) ' "$TMPD/collect.log" | head -20
  local f
  for f in "$@"; do  # the image has torch, nvcc and pytest only
    if grep -qE '^\s*(from|import) (hypothesis|transformer_engine|vllm)\b' "$f"; then
      echo "$label: FAIL $f imports a package the GPU image lacks"
      bad=1
    fi
  done
  if ((n == 0 || bad)) || grep -q '^ERROR' "$TMPD/collect.log"; then
    echo "$label: FAIL the GPU tests do not collect, or none carries the gpu marker"
    touch "$TMPD/dry_failed"
  fi
}

pytest_stage() {  # stage check junit-name files... : pytest -m gpu on the files, one verdict
  local stage=$1 check=$2 junit=$3 rc
  shift 3
  if (($# == 0)); then  # pytest without paths would collect the whole suite
    record "$stage" - 0 "no gpu-marked test file found"
    ((DRY)) || verdict "$check" "no gpu-marked test file found" "all pass, none skipped" FAIL
    return 1
  fi
  run_stage "$stage" env ART_REQUIRE_GPU=1 "$PY" -m pytest -m gpu -p no:cacheprovider -q -rfEs \
    --continue-on-collection-errors --junitxml="$OUT/$junit.xml" "$@" 2>&1 | tee "$TMPD/$junit.log"
  rc=${PIPESTATUS[0]}
  ((DRY)) && return 0
  verdict "$check" "$(grep -E '(passed|failed|error)' "$TMPD/$junit.log" | tail -1 | tr -d '=' | xargs)" \
    "all pass, none skipped" "$( ((rc == 0)) && echo PASS || echo FAIL)"
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
  local entry c line m t v bad=0
  for entry in "${EXPECTED[@]}"; do
    c=${entry%%$'\t'*}
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
  [[ -s $UNPACK_LOG ]] && sed 's/^/gpu_check: /' "$UNPACK_LOG"
  echo "gpu_check: megatron-core: $("$PY" -c 'import megatron.core as m; print(m.__version__, "from", m.__file__)' 2>/dev/null || echo 'not importable (the Megatron twins will fail)')"
  print_plan
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

  # GPU tests: the gpu-marked files that need torch + our packages, then the Megatron twins
  # (megatron-core from the carry on PYTHONPATH, no transformer_engine)
  local -a gpu_tests meg_tests example_tests
  mapfile -t gpu_tests < <(gpu_files "${GPU_TEST_PATHS[@]}")
  mapfile -t meg_tests < <(gpu_files "${MEGATRON_TEST_PATHS[@]}")
  mapfile -t example_tests < <(gpu_files "${EXAMPLE_TEST_PATHS[@]}")
  echo
  echo "gpu_check: ${#gpu_tests[@]} GPU test file(s), ${#meg_tests[@]} Megatron twin file(s), ${#example_tests[@]} example trainer file(s)"
  if ((DRY)); then
    collect_dry gpu-tests "${gpu_tests[@]}"
    collect_dry megatron-gpu-tests "${meg_tests[@]}"
    collect_dry example-trainer "${example_tests[@]}"
  fi
  pytest_stage gpu-tests "GPU tests (ART_REQUIRE_GPU=1, skips fail)" gpu_tests "${gpu_tests[@]}"
  pytest_stage megatron-gpu-tests "Megatron GPU twins (carried megatron-core)" megatron_gpu_tests \
    "${meg_tests[@]}"
  # the example's trainer steps on the GPU (tests/examples/test_trainer_on_device.py, cuda
  # case): recorded rollouts, no vLLM; megatron-core from the carry like the twins above
  pytest_stage example-trainer "Pipeline RL example trainer on CUDA (recorded rollouts)" \
    example_trainer "${example_tests[@]}"

  # HybridEP with real rank processes (IPC, barriers), then the kernels timed alone
  run_stage hybridep-ranks "$PY" bench/gpu_check_hybridep.py --ranks --verdicts "$VERDICTS"
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
