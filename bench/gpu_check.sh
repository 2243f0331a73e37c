#!/usr/bin/env bash
# GPU check for the torchrig training payload (payload/train.py), for one NVIDIA GPU
# (H100/H200-class). Measures; it is not tuned to pass. Finishes within ~8 minutes.
#
#   OUT=/some/dir bash bench/gpu_check.sh
#
# Runs, each under `timeout`, via torchrun with NCCL and world size 1:
#   1. --preset gpt2, bf16, --compile      -> tokens/s and MFU (vs the dense bf16 peak table)
#   2. --preset gpt2, bf16, eager          -> the same without torch.compile
#   3. --preset gpt2 --find-batch-size     -> largest per-GPU batch that fits, less 10%
# Writes $OUT/gpu_check.json (summary) and one log per run ($OUT/{compiled,eager,find_batch}.log).
#
# Knobs (environment): PRESET (gpt2), BATCH (16, per GPU), STEPS (60), SEQ (preset default),
# BUDGET_S (450, whole-script wall-clock budget), PY (python with torch), VENV (where to
# create one if no python3 has torch), REQUIRE_CUDA (1; 0 allows a CPU plumbing dry run).
set -u -o pipefail

START=$(date +%s)
BUDGET_S=${BUDGET_S:-450}
OUT=${OUT:-./gpu_check_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TRAIN=${TRAIN:-$HERE/../payload/train.py}
PRESET=${PRESET:-gpt2}
BATCH=${BATCH:-16}
STEPS=${STEPS:-60}
SEQ=${SEQ:-}
REQUIRE_CUDA=${REQUIRE_CUDA:-1}
VENV=${VENV:-/tmp/torchrig_gpu_check_venv}
SUMMARY="$OUT/gpu_check.json"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")  # scratch; $OUT keeps only the summary and logs
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
        python3 -m venv "$VENV" || fail_json "python3 -m venv failed"
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
        "nccl": None, "device_name": None, "device_count": 0, "bf16_supported": None,
        "total_mem_gib": None}
if torch.cuda.is_available():
    info.update(device_name=torch.cuda.get_device_name(0), device_count=torch.cuda.device_count(),
                bf16_supported=torch.cuda.is_bf16_supported(),
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
COMMON=(--preset "$PRESET" --batch-size "$BATCH" --precision bf16 --log-every 10 --seed 1337)
[ -n "$SEQ" ] && COMMON+=(--seq-len "$SEQ")
[ "$REQUIRE_CUDA" = 1 ] && COMMON+=(--device cuda)

run_one() {  # run_one NAME PLANNED_TIMEOUT_S RESERVE_S ARGS... ; the rest of the budget minus RESERVE is the cap
    local name=$1 planned=$2 reserve=$3; shift 3
    local cap=$(( $(remaining) - reserve ))
    local t=$(( planned < cap ? planned : cap ))
    if [ "$t" -lt 20 ]; then
        log "$name: skipped, ${t}s left in the budget"
        echo "skipped" >"$WORK/$name.rc"
        return
    fi
    log "$name: timeout ${t}s: train.py $*"
    local t0=$(date +%s)
    timeout -k 5 "$t" "$PY" -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node 1 \
        "$TRAIN" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$rc $(( $(date +%s) - t0 )) $t" >"$WORK/$name.rc"
    log "$name: rc=$rc in $(( $(date +%s) - t0 ))s; $(grep -E '^(done|batch_size=)' "$OUT/$name.log" | tail -1)"
}

run_one compiled 220 170 "${COMMON[@]}" --compile --max-steps "$STEPS" --out-json "$WORK/compiled.json"
run_one eager 100 70 "${COMMON[@]}" --max-steps "$STEPS" --out-json "$WORK/eager.json"
run_one find_batch 110 10 --preset "$PRESET" --precision bf16 --find-batch-size --max-batch-size 1024 \
    ${SEQ:+--seq-len "$SEQ"} $([ "$REQUIRE_CUDA" = 1 ] && echo --device cuda) \
    $([ "$REQUIRE_CUDA" = 1 ] || echo --mem-budget-gb 2)

# ---------------------------------------------------------------- summary
"$PY" - "$OUT" "$WORK" "$START" <<'EOF'
import json, os, re, sys, time
out, work, start = sys.argv[1], sys.argv[2], int(sys.argv[3])

def read(p):
    path = os.path.join(out if p.endswith(".log") else work, p)
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None

def run_info(name):
    rc_s = (read(f"{name}.rc") or "missing").split()
    info = {"rc": None, "wall_s": None, "timeout_s": None, "skipped": rc_s[0] in ("skipped", "missing")}
    if not info["skipped"]:
        info.update(rc=int(rc_s[0]), wall_s=int(rc_s[1]), timeout_s=int(rc_s[2]))
        info["timed_out"] = info["rc"] in (124, 137)
    logtxt = read(f"{name}.log") or ""
    steps = [dict(kv.split("=", 1) for kv in ln.split()) for ln in logtxt.splitlines()
             if re.match(r"^step=\d+ ", ln)]
    info["step_lines"] = steps[-10:]
    err = [ln for ln in logtxt.splitlines() if "Error" in ln or "error:" in ln]
    if err:
        info["error_lines"] = err[-5:]
    m = json.loads(read(f"{name}.json") or "null")
    if m:
        for k in ("steps", "final_loss", "tokens_per_s_median", "samples_per_s_median",
                  "step_time_s_median", "mfu_median", "peak_flops", "flops_per_token",
                  "peak_mem_gib", "params", "global_batch", "seq_len", "precision", "compile",
                  "device_name", "backend", "world_size", "torch_version"):
            info[k] = m.get(k)
        losses = m.get("losses") or []
        if losses:
            info["first_logged_loss"] = losses[0][1]
    bs = re.findall(r"^batch_size=(\d+)$", logtxt, re.M)
    if bs:
        info["batch_size"] = int(bs[-1])
        info["probes"] = re.findall(r"^probe (batch_size=\d+.*)$", logtxt, re.M)
    return info

summary = {
    "ok": None,
    "env": json.loads(read("env.json") or "null"),
    "nvidia_smi": (read("nvidia_smi.txt") or "").strip() or None,
    "compiled": run_info("compiled"),
    "eager": run_info("eager"),
    "find_batch_size": run_info("find_batch"),
    "elapsed_s": int(time.time()) - start,
}
c, e = summary["compiled"], summary["eager"]
if c.get("tokens_per_s_median") and e.get("tokens_per_s_median"):
    summary["compile_speedup"] = c["tokens_per_s_median"] / e["tokens_per_s_median"]
summary["ok"] = all(summary[k].get("rc") == 0 for k in ("compiled", "eager", "find_batch_size"))
with open(os.path.join(out, "gpu_check.json"), "w") as f:
    json.dump(summary, f, indent=2)
brief = {k: summary[k] for k in ("ok", "elapsed_s")}
for k in ("compiled", "eager"):
    brief[k] = {x: summary[k].get(x) for x in ("rc", "tokens_per_s_median", "mfu_median",
                                                 "final_loss", "peak_mem_gib")}
brief["find_batch_size"] = summary["find_batch_size"].get("batch_size")
print(json.dumps(brief, indent=2))
EOF
