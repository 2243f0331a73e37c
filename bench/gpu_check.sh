#!/usr/bin/env bash
# GPU check for the torchrig training payload (payload/train.py), for one NVIDIA GPU
# (H100/H200-class). Measures; it is not tuned to pass. Finishes within BUDGET_S (~9 minutes).
#
#   OUT=/some/dir bash bench/gpu_check.sh
#
# Runs, each under `timeout`, with --precision auto (bf16 from sm80, fp16 + GradScaler before):
#   1. find_batch --find-batch-size: largest per-GPU batch that fits, less 10%; it sizes 2-4
#   2. plain      --preset gpt2, eager, one process without torchrun or a process group: the
#                 control, so an NCCL start-up problem cannot hide the model's own figures
#   3. eager      the same under torchrun (NCCL, world size 1)
#   4. compiled   the same with --compile (gets COMPILE_S, the budget's largest share)
# Writes $OUT/gpu_check.json (summary), and per run $OUT/NAME.log and $OUT/NAME.json (metrics).
# Prints a brief JSON, then "FAIL NAME: why" for each problem (with the run's first error
# line). Exit status 0 only if every run exited 0 with tokens/s > 0, a finite loss, a numeric
# MFU, the fused optimizer in use and a batch size > 0 (bench/gpu_check_verdict.py decides);
# a run the budget skips is a failure that says so.
#
# With CANDIDATES=speed (or "NAME:FLAGS;..."), then the speed candidates: each is the compiled
# run with its train.py flags added, alone (cand-NAME), then cand-best: the flags of every
# candidate that beat `compiled` by 2% or more, together (the faster one where two set the same
# option; not run if none did). The summary gives each one's tokens/s, MFU, peak memory and
# ratio to `compiled`; a candidate whose final loss strays from compiled's fails the check.
# Knobs (environment): PRESET (gpt2), BATCH (auto: the search's; per GPU), STEPS (60),
# SEQ (preset default), BUDGET_S (570, whole-script wall-clock budget), COMPILE_S (300, the
# compiled run's cap), PY (python with torch), VENV (where to create one if no python3 has torch),
# REQUIRE_CUDA (1; 0 runs the plumbing on CPU, whose verdict fails: no MFU, no fused AdamW),
# CANDIDATES (none), CAND_S (150, each candidate's cap), PROFILE (none; A:B: a profiler trace of
# steps A to B in the compiled run and in cand-best, its GPU kernels summed by bench/trace_top.py
# into $OUT/NAME_profile.txt).
set -u -o pipefail

START=$(date +%s)
BUDGET_S=${BUDGET_S:-570}
COMPILE_S=${COMPILE_S:-300}
OUT=${OUT:-./gpu_check_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TRAIN=${TRAIN:-$HERE/../payload/train.py}
PRESET=${PRESET:-gpt2}
BATCH=${BATCH:-auto}
STEPS=${STEPS:-60}
SEQ=${SEQ:-}
REQUIRE_CUDA=${REQUIRE_CUDA:-1}
VENV=${VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/torchrig/gpu_check_venv}
SUMMARY="$OUT/gpu_check.json"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")  # scratch; $OUT keeps the summary, logs, metrics
trap 'rm -rf "$WORK"' EXIT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export PYTHONUNBUFFERED=1

log() { printf '[gpu_check %4ds] %s\n' "$(( $(date +%s) - START ))" "$*" >&2; }
remaining() { echo $(( BUDGET_S - ($(date +%s) - START) )); }

fail_json() {  # fail_json MESSAGE : minimal JSON without needing python
    local msg=${1//\"/\'}
    printf '{"ok": false, "error": "%s", "elapsed_s": %d}\n' "$msg" "$(( $(date +%s) - START ))" \
        >"$SUMMARY"
    log "ERROR: $1"
    cat "$SUMMARY"
    exit 1
}

# ---------------------------------------------------------------- python with torch
if [ -z "${PY:-}" ]; then
    if python3 -c 'import torch' >/dev/null 2>&1; then
        PY=$(command -v python3)
    elif [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
        PY=$VENV/bin/python
    else
        log "no python3 with torch: creating $VENV and installing torch from the configured index"
        mkdir -p "$(dirname "$VENV")" && python3 -m venv "$VENV" || fail_json "python3 -m venv failed"
        timeout $(( $(remaining) - 200 > 30 ? $(remaining) - 200 : 30 )) \
            "$VENV/bin/pip" install -q torch >"$OUT/pip.log" 2>&1 || fail_json "pip install torch failed (see pip.log)"
        PY=$VENV/bin/python
    fi
fi
[ -f "$TRAIN" ] || fail_json "train.py not found at $TRAIN"
"$PY" - >"$WORK/env.json" 2>"$WORK/env.err" <<'EOF' || fail_json "torch environment probe failed: $(tail -1 "$WORK/env.err")"
import json, platform, torch
info = {"python": platform.python_version(), "torch": str(torch.__version__),
        "cuda_available": torch.cuda.is_available(), "cuda": torch.version.cuda,
        "nccl": None, "device_name": None, "device_count": 0, "capability": None,
        "total_mem_gib": None}
if torch.cuda.is_available():
    info.update(device_name=torch.cuda.get_device_name(0), device_count=torch.cuda.device_count(),
                capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                total_mem_gib=torch.cuda.get_device_properties(0).total_memory / 2**30)
    try:
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:
        pass
print(json.dumps(info))
EOF
if [ "$REQUIRE_CUDA" = 1 ] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    fail_json "CUDA is not available to $PY"
fi
log "python: $PY; $(cat "$WORK/env.json")"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader \
    >"$WORK/nvidia_smi.txt" 2>&1 || true

# ---------------------------------------------------------------- runs
COMMON=(--preset "$PRESET" --precision auto --seed 1337)
[ -n "$SEQ" ] && COMMON+=(--seq-len "$SEQ")
[ "$REQUIRE_CUDA" = 1 ] && COMMON+=(--device cuda)

# run_one NAME HOW CAP_S NEED_S RESERVE_S ARGS...: HOW is plain (one process, no process
# group) or torchrun (NCCL, world size 1). The run gets CAP_S, or less if the budget minus
# RESERVE_S (what the later runs need) is smaller; under NEED_S it is skipped, and says so.
run_one() {
    local name=$1 how=$2 cap=$3 need=$4 reserve=$5; shift 5
    local left=$(( $(remaining) - reserve ))
    local t=$(( cap < left ? cap : left ))
    if [ "$t" -lt "$need" ]; then
        log "$name: SKIPPED: ${t}s of the budget left for it, it needs ${need}s (raise BUDGET_S)"
        echo "skipped $(( t > 0 ? t : 0 )) $need" >"$WORK/$name.rc"
        return
    fi
    local launcher=(env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u MASTER_ADDR -u MASTER_PORT "$PY")
    [ "$how" = torchrun ] && launcher=("$PY" -m torch.distributed.run --standalone --nnodes 1
                                       --nproc-per-node 1)
    log "$name: timeout ${t}s: $how train.py $*"
    local t0=$(date +%s)
    timeout -k 5 "$t" "${launcher[@]}" "$TRAIN" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$rc $(( $(date +%s) - t0 )) $t" >"$WORK/$name.rc"
    log "$name: rc=$rc in $(( $(date +%s) - t0 ))s; $(grep -E '^(done|batch_size=)' "$OUT/$name.log" | tail -1)"
}

rm -f "$OUT"/{find_batch,plain,eager,compiled}.{log,json}  # no stale figures from an earlier run
# Caps and needs (s): find_batch 120/40, plain 90/30, eager 90/30, compiled COMPILE_S/90; each
# run's reserve is the sum of the later runs' needs (the last one's: the verdict's few seconds).
run_one find_batch torchrun 120 40 150 "${COMMON[@]}" --find-batch-size --max-batch-size 1024 \
    $([ "$REQUIRE_CUDA" = 1 ] || echo --mem-budget-gb 2)
if [ "$BATCH" = auto ]; then  # the search's answer sizes the throughput runs
    BATCH=$(sed -n 's/^batch_size=\([1-9][0-9]*\)$/\1/p' "$OUT/find_batch.log" 2>/dev/null | tail -1)
    [ -n "$BATCH" ] || { BATCH=16; log "no batch size found: the runs use --batch-size 16"; }
fi
TRAIN_ARGS=("${COMMON[@]}" --batch-size "$BATCH" --log-every 10 --max-steps "$STEPS")
run_one plain plain 90 30 120 "${TRAIN_ARGS[@]}" --out-json "$OUT/plain.json"
run_one eager torchrun 90 30 90 "${TRAIN_ARGS[@]}" --out-json "$OUT/eager.json"
CANDIDATES=${CANDIDATES:-}
CAND_S=${CAND_S:-150}
# The speed candidates of issue 26, each alone: the cross-entropy's loss and gradient in one
# Triton kernel (payload/ce_kernel.py), Inductor's own kernels tuned by coordinate descent (these
# two first: not yet measured on a GPU), cuDNN's attention kernel (where torch would choose
# another), cross-entropy in chunks (the logits never held in full), CUDA graphs for the step,
# and Inductor's GEMM autotuning (long to compile: last, the budget may skip it).
SPEED_CANDIDATES="ce-triton:--ce-kernel triton;tune:--compile-tune;cudnn:--attention cudnn;ce-chunks:--ce-chunks 16;cudagraphs:--compile-mode reduce-overhead;autotune:--compile-mode max-autotune-no-cudagraphs"
[ "$CANDIDATES" = speed ] && CANDIDATES=$SPEED_CANDIDATES
PROFILE=${PROFILE:-}
rm -f "$OUT"/cand-*.{log,json} "$OUT"/*_profile.txt
# profiled NAME: the flags that profile run NAME when PROFILE asks for it
profiled() { [ -n "$PROFILE" ] && echo "--profile-steps $PROFILE --profile-dir $WORK/profile-$1"; }
# top_kernels NAME: the profiled steps' GPU kernels, summed (a run without a trace: nothing)
top_kernels() {
    local trace=$WORK/profile-$1/trace_rank0_steps${PROFILE/:/-}.json
    [ -n "$PROFILE" ] && [ -f "$trace" ] || return 0
    "$PY" "$HERE/trace_top.py" "$trace" $(( ${PROFILE#*:} - ${PROFILE%:*} + 1 )) >"$OUT/$1_profile.txt" 2>&1
}
# shellcheck disable=SC2046
run_one compiled torchrun "$COMPILE_S" 90 5 "${TRAIN_ARGS[@]}" --compile --out-json "$OUT/compiled.json" \
    $(profiled compiled)
top_kernels compiled

# run_candidate NAME FLAGS [ARGS...]: the compiled run with FLAGS (word-split on purpose) and ARGS
run_candidate() {
    local name=$1 flags=$2; shift 2
    echo "$flags" >"$WORK/cand-$name.flags"
    # shellcheck disable=SC2086
    run_one "cand-$name" torchrun "$CAND_S" 60 5 "${TRAIN_ARGS[@]}" --compile $flags "$@" \
        --out-json "$OUT/cand-$name.json"
}
if [ -n "$CANDIDATES" ]; then
    IFS=';' read -ra SPECS <<<"$CANDIDATES"
    LATER=()  # autotune goes after cand-best: it is the slowest to compile
    for spec in "${SPECS[@]}"; do
        case $spec in autotune:*) LATER+=("$spec"); continue ;; esac
        run_candidate "${spec%%:*}" "${spec#*:}"
    done
    BEST=$("$PY" "$HERE/gpu_check_verdict.py" best "$OUT" "$WORK")
    if [ -n "$BEST" ]; then
        # shellcheck disable=SC2046
        run_candidate best "$BEST" $(profiled cand-best)
        top_kernels cand-best
    else
        log "cand-best: no candidate beat compiled by 2%: not run"
    fi
    for spec in ${LATER[@]+"${LATER[@]}"}; do run_candidate "${spec%%:*}" "${spec#*:}"; done
fi

# ---------------------------------------------------------------- summary and verdict
"$PY" "$HERE/gpu_check_verdict.py" "$OUT" "$WORK" "$START" "$BUDGET_S"  # its status is ours
