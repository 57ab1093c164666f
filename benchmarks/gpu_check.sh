#!/usr/bin/env bash
# The trainer's GPU checks, one stage at a time, each under its own timeout (sum 565 s), so the
# whole run ends inside the device tool's limit even if a stage hangs. Stages, most valuable first:
#
#   stage      limit  what                                                     figures
#   smoke       45 s  versions, device name, ONE Megatron-Core bf16 step      gpu_stages.json (smoke.*)
#   train       75 s  issue 11 item 8: bf16 Megatron steps (0.2B, 8 x 1024),
#                     offload/restore, log-prob agreement fp32 and bf16        ablation_gpu.json
#   tree       100 s  issue 11: tree vs expanded fwd+bwd timing, FlexAttention tree_gpu.json
#   moe         90 s  issue 20: Megatron bf16 MoE (alltoall), export, replay   moe_gpu.json
#   offpolicy   40 s  issue 21: pi_prox drift and mismatch in bf16, both backends gpu_stages.json (offpolicy.*)
#   routing     50 s  issue 29 item 5: train.routing_replay fp32 + bf16, both  gpu_stages.json (routing.*)
#   hybrid      55 s  issue 30: Gated DeltaNet tree vs expanded, Megatron's GDN hybrid_gpu.json
#   xlong      100 s  issue 28: FlexAttention + recompute + chunked log-probs,
#                     one ~150K-token case-study tree row                      xlong_gpu.json
#   cp          10 s  issue 28 item 3: context parallelism; needs >= 2 GPUs and Transformer Engine,
#                     SKIPPED on one GPU (~2 s; elsewhere set GPU_CHECK_CP_TIMEOUT) gpu_stages.json (cp.*)
# The limits sum to 565 s; the install, nvidia-smi and bookkeeping add ~10 s (the device tool
# allows 600 s a command; on an H200, three stages of run 3 ran past their old limits). Small
# stages' figures travel inside gpu_stages.json so that $OUT holds at most 8 files (the device tool's limit).
#
# Usage (repo root):
#   benchmarks/gpu_check.sh fetch            here, once: megatron-core for the device's Python 3.12 into .whl/
#   benchmarks/gpu_check.sh [STAGE ...]      on the device (run tool: carry [".whl"]); default: every stage
#   benchmarks/gpu_check.sh --dry-run [STAGE ...]   here, on the CPU: the same stages with --dry-run
#                                                   (tiny float32 models; set PYTHON to the venv's python)
#
# After EACH stage its JSON and the log so far are in $OUT (the device tool's folder; a temp folder
# when unset): gpu_check.log, gpu_stages.json (per stage: ok, rc, s, timeout_s, timed_out; plus the
# merged stages' figures) and the stage files above; benchmarks/results/ holds the same JSON. A stage killed by
# its timeout keeps the figures it had written (rc 124). With stages named, gpu_stages.json keeps
# the other stages' entries from an earlier run on the same machine. Exit status: 0 when every
# stage run passed, else 1.
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS="${GYRE_WHEELS:-.whl}"
MEGATRON="megatron-core==0.16.1"   # the version gyre/train/megatron_cpu.py and the tests were written against

if [ "${1:-}" = "fetch" ]; then
    exclude="$(git rev-parse --git-path info/exclude)"
    mkdir -p "$(dirname "$exclude")"
    grep -qxF "/.whl/" "$exclude" 2>/dev/null || echo "/.whl/" >> "$exclude"
    ${PYTHON:-python3} -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WHEELS" "$MEGATRON"
    ls -la "$WHEELS"
    exit 0
fi

ALL=(smoke train tree moe offpolicy routing hybrid xlong cp)
declare -A LIMIT=([smoke]=45 [train]=75 [tree]=60 [moe]=45 [offpolicy]=40 [routing]=30 [hybrid]=55 [xlong]=50
                  [cp]=${GPU_CHECK_CP_TIMEOUT:-10})
declare -A FILE=([smoke]=smoke_gpu.json [train]=ablation_gpu.json [tree]=tree_gpu.json [moe]=moe_gpu.json
                 [offpolicy]=offpolicy_gpu.json [routing]=routing_replay_gpu.json [hybrid]=hybrid_gpu.json
                 [xlong]=xlong_gpu.json [cp]=cp_gpu.json)
MERGED=" smoke offpolicy routing cp "  # small figures: inside gpu_stages.json, not copied on their own
DRY=()
if [ "${1:-}" = "--dry-run" ]; then
    DRY=(--dry-run)
    shift
    for s in "${!LIMIT[@]}"; do LIMIT[$s]=$((LIMIT[$s] * 5)); done  # the CPU here is slow and shared
fi
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=("${ALL[@]}")
for s in "${STAGES[@]}"; do
    if [ -z "${LIMIT[$s]:-}" ]; then
        echo "gpu_check: unknown stage '$s'; choose from: ${ALL[*]} (or 'fetch', '--dry-run')" >&2
        exit 2
    fi
done

PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
if [ ${#DRY[@]} -eq 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || { echo "gpu_check: the wheel install failed (carry .whl with megatron_core in it)"; export PYTHONPATH=$PWD; }
    RESULTS="$PWD/benchmarks/results"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    RESULTS="$(mktemp -d)"   # the dry run leaves benchmarks/results alone
fi
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT" "$RESULTS"
export GYRE_GPU_RESULTS="$RESULTS"
LOG="$OUT/gpu_check.log"
exec > >(tee -a "$LOG") 2>&1
TEE=$!

echo "gpu_check: stages ${STAGES[*]} ${DRY[*]} (limits: $(for s in "${STAGES[@]}"; do printf '%s=%ss ' "$s" "${LIMIT[$s]}"; done)); OUT=$OUT; $(date -u +%FT%TZ)"
[ ${#DRY[@]} -eq 0 ] && { nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader || true; }

# gpu_stages.json: a fresh one for a full run; a named-stages rerun updates the earlier one
STAGES_JSON="$RESULTS/gpu_stages.json"
[ ${#STAGES[@]} -eq ${#ALL[@]} ] && rm -f "$STAGES_JSON"
record() {  # stage rc seconds [note]: update gpu_stages.json (flat) and copy it and the stage's figures to $OUT
    "$PY" - "$STAGES_JSON" "$1" "$2" "$3" "${LIMIT[$1]}" "$RESULTS/${FILE[$1]}" "${4:-}" "$MERGED" <<'PY'
import json, re, sys
from pathlib import Path

path, stage, rc, secs, limit, figures, note, merged = sys.argv[1:]
p = Path(path)
d = json.loads(p.read_text()) if p.exists() else {}
d = {k: v for k, v in d.items() if not k.startswith(stage + ".")}
d.update({f"{stage}.ok": rc == "0", f"{stage}.rc": int(rc), f"{stage}.s": round(float(secs), 1),
          f"{stage}.timeout_s": int(limit), f"{stage}.timed_out": rc in ("124", "137")})
if note:
    d[f"{stage}.note"] = note
f = Path(figures)
if stage in merged.split() and f.exists():  # small: their figures travel inside gpu_stages.json
    d.update({f"{stage}.{k}": v for k, v in json.loads(f.read_text()).items()})
this_run = [k for k in d if k.endswith(".ok") and not re.match(r"run\d+\.", k)]  # runN.*: earlier runs kept
d["stages_run"] = sorted(k[:-3] for k in this_run)
d["all_ok"] = all(d[k] for k in this_run)
p.write_text(json.dumps(d, indent=1, sort_keys=True) + "\n")
PY
    cp "$STAGES_JSON" "$OUT/" 2>/dev/null
    case "$MERGED" in *" $1 "*) ;; *) [ -f "$RESULTS/${FILE[$1]}" ] && cp "$RESULTS/${FILE[$1]}" "$OUT/" ;; esac
}

status=0
for s in "${STAGES[@]}"; do
    rm -f "$RESULTS/${FILE[$s]}"  # only this run's figures go back
    t=${LIMIT[$s]}
    echo "=== stage $s (timeout ${t} s) $(date -u +%T)"
    start=$(date +%s%N)
    note=""
    case "$s" in
        smoke|offpolicy|routing|xlong) timeout -k 5 "$t" "$PY" benchmarks/train_gpu_check.py "$s" "${DRY[@]}" ;;
        train) timeout -k 5 "$t" "$PY" benchmarks/bench_train_gpu.py --part steps "${DRY[@]}" ;;
        tree) timeout -k 5 "$t" "$PY" benchmarks/bench_train_gpu.py --part tree "${DRY[@]}" ;;
        moe) timeout -k 5 "$t" "$PY" benchmarks/moe_gpu_check.py "${DRY[@]}" ;;
        hybrid) timeout -k 5 "$t" "$PY" benchmarks/hybrid_gpu_check.py "${DRY[@]}" ;;
        cp)
            gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
            if [ ${#DRY[@]} -eq 0 ] && [ "$gpus" -ge 2 ] && "$PY" -c "import transformer_engine" 2>/dev/null; then
                timeout -k 5 "$t" "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/cp_gpu_check.py
            else
                note="SKIPPED: $gpus GPU(s) visible; needs >= 2 and Transformer Engine (never on the CPU)"
                echo "context parallelism: $note"
                true
            fi ;;
    esac
    rc=$?
    ms=$(( ($(date +%s%N) - start) / 1000000 ))
    secs="$((ms / 1000)).$(printf %03d $((ms % 1000)))"
    [ "$rc" -eq 0 ] || status=1
    echo "=== stage $s: rc $rc, ${secs} s$([ "$rc" -eq 124 ] && echo ' (TIMED OUT)')"
    record "$s" "$rc" "$secs" "$note"
done
echo "gpu_check: done, status $status; $(date -u +%FT%TZ)"
exec >&- 2>&-
wait "$TEE" 2>/dev/null
exit $status
