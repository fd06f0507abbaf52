#!/usr/bin/env bash
# The GPU checks (docs/gpu.md) on a lent one-GPU machine, part by part, each under its own time cap,
# every result written to $OUT as soon as it exists (the device tool brings $OUT back).
#
#   bash scripts/gpu/run_checks.sh env tests profile fig15     # call 1: about 6 minutes
#   bash scripts/gpu/run_checks.sh train_debug train_modes     # call 2: about 5 minutes
#   REHEARSAL=1 OUT=/tmp/rehearsal bash scripts/gpu/run_checks.sh   # here, on the CPU, tiny sizes
#
# Needs .gpu/ beside the sources (scripts/gpu/prepare.sh builds it; the device call carries it).
# Parts (default: all, in this order):
#   env          versions, the GPU, and an import of the trainer (fails fast if .gpu/ is stale)
#   tests        tests/test_gpu.py: CUDA attention backends and CP ranks against the references
#   profile      the H100 attention throughput table (tools.cp_profile, 7B heads, bf16) -> $OUT
#   fig15        Figure 15: one layer's attention under per-sequence / per-document / adaptive CP,
#                CP = 4, 128K, dist_wlbllm packed by wlb, adaptive deciding with that table
#   train_debug  ./run_train.sh as shipped (train_configs/debug_gpu.toml)
#   train_modes  byte_1B at 64K context in plain_4d, fixed_4d and wlb: tokens/s, MFU, memory, and
#                the metrics JSONL (measured micro-batch times) of each, as one archive
set -uo pipefail  # not -e: a failing part is reported and the next one runs
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [[ " $* " == *" --help "* || " $* " == *" -h "* ]]; then  # the header above, as text
    sed -n '2,/^set -/p' "${BASH_SOURCE[0]}" | sed -n 's/^# \{0,1\}//p'
    exit 0
fi
cd "$ROOT"
SELF="$ROOT/scripts/gpu/run_checks.sh"
GPU_DIR=${GPU_DIR:-$ROOT/.gpu}
OUT=${OUT:-$ROOT/outputs/gpu_checks}
WORK=${WORK:-$ROOT/outputs/gpu_work}  # run folders: checkpoints and logs stay on the machine
REHEARSAL=${REHEARSAL:-0}
export PYTHONPATH="$ROOT:$GPU_DIR/site${PYTHONPATH:+:$PYTHONPATH}"
export WLB_PYTHON=${WLB_PYTHON:-python3}  # run_train.sh and run_tests.sh then install nothing
export PYTHONUNBUFFERED=1
PY=$WLB_PYTHON
LOG="$OUT/checks.log"
WORKLOAD="$GPU_DIR/workloads/dist_wlbllm.json"

if [ "$REHEARSAL" = 1 ]; then  # the same commands at sizes a 2-core CPU runs in seconds
    DEVICE=cpu; HEADS=(--heads 2 --kv-heads 1 --head-dim 16); GRID=(--lengths 16,64,256,1024)
    FIG=(--context-len 4096 --micro-batches 4 --measure-micro-batches 4 --measure-repeats 1)
    TRAIN=(--model.flavor tiny --training.seq_len 1024 --training.global_batch_size 2)
    SMAX=1280; STEPS=3; CAPS=(60 120 120 120 240 300)
else
    DEVICE=cuda; HEADS=(--heads 32 --kv-heads 8 --head-dim 128)
    GRID=(--repeats 2 --pairs-per-cell 268435456 --max-tokens 262144)
    FIG=(--context-len 131072 --micro-batches 4 --measure-micro-batches 12 --measure-repeats 2)
    TRAIN=(--model.flavor byte_1B --training.seq_len 65536 --training.global_batch_size 2
           --activation_checkpoint.mode full)
    SMAX=81920; STEPS=6; CAPS=(60 100 200 150 120 330)
fi

part() {  # part NAME CAP_SECONDS COMMAND...: output in $OUT/NAME.log, its tail in checks.log
    local name=$1 cap=$2 start rc
    shift 2
    echo "== $name (at most ${cap} s): $*" >>"$LOG"
    start=$(date +%s)
    timeout -k 10 "$cap" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "== $name: exit $rc after $(($(date +%s) - start)) s$([ $rc = 124 ] && echo ' (time cap)')" >>"$LOG"
    tail -n 8 "$OUT/$name.log" | sed 's/^/   /' >>"$LOG"
    return $rc
}

env_check() {
    nvidia-smi -L 2>&1 || echo "no nvidia-smi"
    "$PY" - <<'PYEOF'
import platform

import torch
import torchtitan_wlb.train  # noqa: F401  (activates CPU support first where there is no GPU)
import torchtitan

from torchtitan_wlb.attention.cuda import cuda_available

print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("torchtitan", getattr(torchtitan, "__version__", "?"), "from", torchtitan.__file__)
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0))
print("backends: flash", cuda_available("flash"), "torch_varlen", cuda_available("torch_varlen"))
PYEOF
}

train_modes() {
    local mode rc=0
    for mode in plain_4d fixed_4d wlb; do  # S_max as e2e_bench gives every mode
        echo "=== $mode"
        NGPU=1 ./run_train.sh "${TRAIN[@]}" --wlb.micro_batch_max_len "$SMAX" --wlb.mode "$mode" \
            --training.steps "$STEPS" --job.dump_folder "$WORK/$mode" --checkpoint.no-enable \
            --wlb.metrics_jsonl --metrics.log_freq 1 --metrics.disable_color_printing || rc=$?
    done
    tar -czf "$OUT/train_modes_metrics.tar.gz" -C "$WORK" \
        $(cd "$WORK" && find plain_4d fixed_4d wlb -name '*.jsonl' 2>/dev/null)
    return $rc
}

case "${1:-}" in  # a part that is a function runs in its own process, under `timeout`
    __env) env_check; exit $? ;;
    __train_modes) train_modes; exit $? ;;
esac
export GPU_DIR OUT WORK REHEARSAL
ALL=(env tests profile fig15 train_debug train_modes)
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=("${ALL[@]}")
for p in "${parts[@]}"; do
    if [[ " ${ALL[*]} " != *" $p "* ]]; then
        echo "run_checks.sh: unknown part '$p'; accepted: ${ALL[*]}" >&2
        exit 2
    fi
done
mkdir -p "$OUT" "$WORK"
echo "== $(date -u +%FT%TZ) parts: ${parts[*]} (rehearsal: $REHEARSAL)" >>"$LOG"
for p in "${parts[@]}"; do
    case "$p" in
        env) part env "${CAPS[0]}" bash "$SELF" __env ;;
        tests) part tests "${CAPS[1]}" "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py ;;
        profile) part profile "${CAPS[2]}" "$PY" -m torchtitan_wlb.tools.cp_profile \
            --device "$DEVICE" "${HEADS[@]}" "${GRID[@]}" --out "$OUT/cp_profile_$DEVICE.json" ;;
        fig15) part fig15 "${CAPS[3]}" "$PY" -m torchtitan_wlb.tools.cp_bench --lengths "$WORKLOAD" \
            --cp 4 --packer wlb "${FIG[@]}" --measure --device "$DEVICE" "${HEADS[@]}" \
            --adaptive-candidates per_sequence,per_document \
            $([ -f "$OUT/cp_profile_$DEVICE.json" ] && echo --profile "$OUT/cp_profile_$DEVICE.json") \
            --no-torch-balancers --json ;;
        train_debug) part train_debug "${CAPS[4]}" ./run_train.sh ;;
        train_modes) part train_modes "${CAPS[5]}" bash "$SELF" __train_modes ;;
    esac
done
echo "== done $(date -u +%FT%TZ)" >>"$LOG"
cat "$LOG"
