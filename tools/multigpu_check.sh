#!/usr/bin/env bash
# Issue 11: every multi-GPU check and benchmark of megatron_ext, in one run per machine kind.
#
# Usage (from the repository root, PYTHONPATH set as in BENCHMARKS.md, "Multi-GPU checks"):
#   tools/multigpu_check.sh [--steps LIST] [--dry-run] [NUM_GPUS]
#
#   NUM_GPUS  2, 4 or 8; default: the GPUs `nvidia-smi -L` lists, rounded down to 8, 4 or 2.
#             Fewer than present: only the first NUM_GPUS are made visible (CUDA_VISIBLE_DEVICES).
#   --steps   comma-separated subset, in this order (default: all):
#               preflight   versions, GPU count, NVLink safety settings
#               rowwise     pytest tests/gpu/test_rowwise_multigpu.py (symm vs torch transport, poison,
#                           leases, graphs at EP>1 through the runner, the EP=2 stress of 20 steps per
#                           setting, a capture failing on one rank, a 2-rank run's clean exit)
#               faults      pytest tests/gpu/test_rank_death_multigpu.py (a rank dies mid-layer with the
#                           symm transport: the survivor exits with the phase named within 120 s)
#               ddp         pytest tests/gpu/test_ddp_megatron_gpu.py (multi-group DDP over NCCL)
#               deepep      pytest tests/gpu/test_deepep_multigpu.py, if that file exists
#               transport   torchrun tools/bench_transport.py (PUT/GET GB/s per GPU vs 450 GB/s)
#               ep          torchrun tools/bench_ep.py (EP layer benchmark, report's EP8 shape)
#               arena       torchrun tools/bench_dropless_arena.py (4 MoE layers: the dropless arena against
#                           Megatron's dropless path, the worst case and per-layer bounds; memory of the
#                           largest rank, skewed routing; issue 20's EP>1 figures)
#               functional  tests/functional_tests/runner.py on the 8-GPU case (gpt/moe_rowwise_ep8,
#                           else the first gpt/moe_rowwise_ep8* case); 8 GPUs only. Without golden
#                           values it generates them (--generate) and says so.
#   --dry-run print each step's command, run nothing.
#
# Installs nothing. Exports NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
# NVSHMEM_DISABLE_NVLS=1 (NVLink multicast stays off, also in every child process).
# A failing step does not stop the later ones; the script prints a summary and exits 1 if any
# step failed (2 for a usage error). Benchmark JSON goes to bench/results/; when $OUT is set
# (the device runner's output folder), the new JSON files, generated golden values, every
# step's log and the summary are also copied there as each step finishes.
set -u -o pipefail

cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=python3
ALL_STEPS=(preflight rowwise faults ddp deepep transport ep arena functional)
RESULTS_DIR="$REPO/bench/results"

export NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_DISABLE_NVLS=1

# Per-step wall-clock limits in seconds (coreutils timeout; the step is killed and counted FAILED).
declare -A LIMIT=([preflight]=120 [rowwise]=570 [faults]=300 [ddp]=240 [deepep]=480 [transport]=300 [ep]=480 [arena]=420 [functional]=1320)

usage() { sed -n '2,/^set -u/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; }

DRY_RUN=0
STEPS_ARG=""
NGPU_ARG=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --steps) shift
            if [ -z "${1:-}" ]; then echo "multigpu_check: --steps needs a comma-separated list" >&2; usage >&2; exit 2; fi
            STEPS_ARG="$1" ;;
        --steps=*) STEPS_ARG="${1#--steps=}" ;;
        -h|--help) usage; exit 0 ;;
        [0-9]*) NGPU_ARG="$1" ;;
        *) echo "multigpu_check: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

# ------------------------------------------------------------------------------ steps and GPUs
STEPS=("${ALL_STEPS[@]}")
if [ -n "$STEPS_ARG" ]; then
    IFS=',' read -r -a STEPS <<< "$STEPS_ARG"
    for step in "${STEPS[@]}"; do
        if [[ ! " ${ALL_STEPS[*]} " == *" $step "* ]]; then
            echo "multigpu_check: unknown step '$step'; choose from: ${ALL_STEPS[*]}" >&2
            exit 2
        fi
    done
fi

detected_gpus() {
    if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true; else echo 0; fi
}

if [ -n "$NGPU_ARG" ]; then
    NGPU=$NGPU_ARG
    case "$NGPU" in 2|4|8) ;; *) echo "multigpu_check: NUM_GPUS must be 2, 4 or 8, got $NGPU" >&2; exit 2 ;; esac
else
    present=$(detected_gpus)
    NGPU=0
    for n in 8 4 2; do if [ "$present" -ge "$n" ]; then NGPU=$n; break; fi; done
    if [ "$NGPU" -eq 0 ] && [ "$DRY_RUN" -eq 0 ]; then
        echo "multigpu_check: needs 2+ GPUs, nvidia-smi lists $present; pass NUM_GPUS to override" >&2
        exit 2
    fi
    [ "$NGPU" -eq 0 ] && NGPU=8  # dry run on a machine without GPUs: show the 8-GPU plan
fi
if [ "$DRY_RUN" -eq 0 ]; then
    present=$(detected_gpus)
    if [ "$present" -gt "$NGPU" ] && [ -z "${CUDA_VISIBLE_DEVICES:-}" ]; then
        CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((NGPU - 1)))
        export CUDA_VISIBLE_DEVICES
    fi
fi

# ------------------------------------------------------------------------------ output folders
STAMP=$(date +%Y%m%d-%H%M%S)
if [ "$DRY_RUN" -eq 1 ]; then
    LOG_DIR=$(mktemp -d "/tmp/multigpu_check_dry_XXXX")
    trap 'rm -rf "$LOG_DIR"' EXIT
elif [ -n "${OUT:-}" ]; then
    LOG_DIR="$OUT/multigpu_check_$STAMP"
else
    LOG_DIR=$(mktemp -d "/tmp/multigpu_check_${STAMP}_XXXX")
fi
mkdir -p "$LOG_DIR"
[ "$DRY_RUN" -eq 1 ] || mkdir -p "$RESULTS_DIR"
# Outside $OUT: the device runner brings back at most 8 files, no more than 2 folders down.
MARKER=$(mktemp "/tmp/multigpu_check_started_XXXX")
touch "$MARKER"

collect_outputs() {  # new result JSONs (and golden values) into $OUT, after every step
    [ -n "${OUT:-}" ] || return 0
    mkdir -p "$OUT/bench/results"
    find "$RESULTS_DIR" -maxdepth 1 -name '*.json' -newer "$MARKER" -exec cp -p {} "$OUT/bench/results/" \;
    if [ -d tests/functional_tests/test_cases ]; then
        find tests/functional_tests/test_cases -name 'golden_values_*.json' -newer "$MARKER" | while read -r golden; do
            # flattened: test_cases/<model>/<case>/golden_values_X.json -> golden/<model>-<case>-golden_values_X.json
            mkdir -p "$OUT/golden"
            cp -p "$golden" "$OUT/golden/$(echo "${golden#tests/functional_tests/test_cases/}" | tr / -)"
        done
    fi
}

# ------------------------------------------------------------------------------ running a step
declare -A STATUS NOTE SECONDS_TAKEN
FAILED=0

record() {  # record STEP STATUS NOTE
    STATUS[$1]=$2
    NOTE[$1]=$3
    [ "$2" = FAIL ] && FAILED=1
    printf '%-11s %-9s %s\n' "$1" "$2" "$3" >> "$LOG_DIR/summary.txt"
}

run_logged() {  # run_logged STEP CMD... -> the command's exit code; output to screen and STEP.log
    local step=$1; shift
    echo
    echo "=== [$step] $*"
    if [ "$DRY_RUN" -eq 1 ]; then return 0; fi
    local start=$SECONDS
    timeout -k 30 "${LIMIT[$step]}" "$@" 2>&1 | tee -a "$LOG_DIR/$step.log"
    local rc=${PIPESTATUS[0]}
    SECONDS_TAKEN[$step]=$((${SECONDS_TAKEN[$step]:-0} + SECONDS - start))
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && echo "=== [$step] killed after ${LIMIT[$step]} s"
    return "$rc"
}

finish_step() {  # finish_step STEP RC [what passing means]
    local step=$1 rc=$2
    if [ "$DRY_RUN" -eq 1 ]; then record "$step" DRY "command printed"; return; fi
    if [ "$rc" -eq 0 ]; then record "$step" PASS "${3:-exit 0}"; else record "$step" FAIL "exit $rc (log: $LOG_DIR/$step.log)"; fi
    collect_outputs
}

have_pytest() { "$PY" -c 'import pytest' >/dev/null 2>&1; }

run_pytest_file() {  # run_pytest_file STEP FILE
    local step=$1 file=$2
    if [ ! -f "$file" ]; then record "$step" SKIP "$file does not exist"; return; fi
    if [ "$DRY_RUN" -eq 1 ] || have_pytest; then
        run_logged "$step" "$PY" -m pytest -q -rs -p no:cacheprovider "$file"
        local rc=$?
        if [ "$DRY_RUN" -eq 0 ] && [ "$rc" -eq 0 ] && ! tail -n 3 "$LOG_DIR/$step.log" | grep -Eq '[0-9]+ passed'; then
            record "$step" SKIP "every test skipped (reasons in $LOG_DIR/$step.log)"
            return
        fi
        finish_step "$step" "$rc"
    elif grep -q '__name__ == "__main__"' "$file"; then
        run_logged "$step" "$PY" "$file"
        finish_step "$step" $? "exit 0 (run as a script: pytest is not installed)"
    else
        record "$step" FAIL "pytest is not installed and $file has no script entry; fetch the pytest wheels (BENCHMARKS.md, Multi-GPU)"
    fi
}

step_preflight() {
    run_logged preflight "$PY" - "$NGPU" <<'PYEOF'
import os, sys
import torch
import megatron.core
import megatron_ext
need = int(sys.argv[1])
print(f"torch {torch.__version__} cuda {torch.version.cuda}; megatron-core {megatron.core.__version__}; "
      f"megatron_ext {megatron_ext.__version__}")
print("visible GPUs:", torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "CUDA_VISIBLE_DEVICES"):
    print(f"{name}={os.environ.get(name)}")
assert os.environ.get("NCCL_NVLS_ENABLE") == "0" and os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") == "1" \
    and os.environ.get("NVSHMEM_DISABLE_NVLS") == "1", "NVLink multicast settings are not in place"
assert torch.cuda.device_count() >= need, f"need {need} GPUs, {torch.cuda.device_count()} visible"
PYEOF
    finish_step preflight $?
}

torchrun_cmd() { echo "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU"; }

step_transport() {
    # shellcheck disable=SC2046
    run_logged transport $(torchrun_cmd) tools/bench_transport.py --results-dir "$RESULTS_DIR"
    finish_step transport $?
}

step_ep() {
    # shellcheck disable=SC2046
    run_logged ep $(torchrun_cmd) tools/bench_ep.py --results-dir "$RESULTS_DIR"
    finish_step ep $?
}

step_arena() {
    # shellcheck disable=SC2046
    run_logged arena $(torchrun_cmd) tools/bench_dropless_arena.py --results-dir "$RESULTS_DIR" \
        --paths megatron_gg,dropless,per_layer,arena,arena_spill,per_layer_moe_act,arena_moe_act --capacity-factor 1.5 \
        --arena-capacity-factor 1.5 --region-factor 0.9 --skew 0.25  # the skew sends rank 0 ~1.36x T*K: 1.5 drops none
    finish_step arena $?
}

functional_case() {  # the 8-GPU rowwise case that exists, or nothing
    local root=tests/functional_tests/test_cases
    if [ -d "$root/gpt/moe_rowwise_ep8" ]; then echo gpt/moe_rowwise_ep8; return; fi
    local found
    found=$(find "$root/gpt" -mindepth 1 -maxdepth 1 -type d -name 'moe_rowwise_ep8*' 2>/dev/null | sort | head -n 1)
    [ -n "$found" ] && echo "gpt/$(basename "$found")"
}

step_functional() {
    local runner=tests/functional_tests/runner.py case rc
    if [ ! -f "$runner" ]; then record functional SKIP "$runner does not exist"; return; fi
    case=$(functional_case)
    if [ -z "$case" ]; then record functional SKIP "no gpt/moe_rowwise_ep8* case under tests/functional_tests/test_cases"; return; fi
    if [ "$NGPU" -lt 8 ]; then record functional SKIP "$case needs 8 GPUs, this run uses $NGPU"; return; fi
    run_logged functional "$PY" "$runner" --case "$case" --output-dir "$LOG_DIR/functional"
    rc=$?
    if [ "$DRY_RUN" -eq 1 ]; then record functional DRY "command printed (adds --generate when $case has no golden values)"; return; fi
    case "$rc" in
        0) record functional PASS "$case matches its golden values" ;;
        2) run_logged functional "$PY" "$runner" --case "$case" --generate --output-dir "$LOG_DIR/functional"
           rc=$?
           if [ "$rc" -eq 0 ]; then
               record functional GENERATED "$case had no golden values: written from this run (not a comparison; commit them)"
           else
               record functional FAIL "$case --generate exited $rc (log: $LOG_DIR/functional.log)"
           fi ;;
        3) record functional SKIP "$case: the runner skipped it (fewer GPUs visible than it needs)" ;;
        *) record functional FAIL "$case exited $rc (1: a check failed, 4: training failed; log: $LOG_DIR/functional.log)" ;;
    esac
    collect_outputs
}

# ------------------------------------------------------------------------------ main
echo "multigpu_check: $NGPU GPUs, steps: ${STEPS[*]}; logs: $LOG_DIR; results: $RESULTS_DIR${OUT:+ (copied to \$OUT)}"
echo "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST=$TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS=$NVSHMEM_DISABLE_NVLS"
: > "$LOG_DIR/summary.txt"
for step in "${STEPS[@]}"; do
    case "$step" in
        preflight) step_preflight ;;
        rowwise) run_pytest_file rowwise tests/gpu/test_rowwise_multigpu.py ;;
        faults) run_pytest_file faults tests/gpu/test_rank_death_multigpu.py ;;
        ddp) run_pytest_file ddp tests/gpu/test_ddp_megatron_gpu.py ;;
        deepep) run_pytest_file deepep tests/gpu/test_deepep_multigpu.py ;;
        transport) step_transport ;;
        ep) step_ep ;;
        arena) step_arena ;;
        functional) step_functional ;;
    esac
done

echo
echo "=== multigpu_check summary ($NGPU GPUs)"
for step in "${STEPS[@]}"; do
    printf '%-11s %-9s %6ss  %s\n' "$step" "${STATUS[$step]:-?}" "${SECONDS_TAKEN[$step]:-0}" "${NOTE[$step]:-}"
done
if [ "$FAILED" -ne 0 ]; then
    echo "multigpu_check: FAILED (see the logs in $LOG_DIR)"
    exit 1
fi
echo "multigpu_check: no step failed"
