#!/usr/bin/env bash
# The GPU checks (docs/gpu.md) on a machine with one CUDA GPU, part by part, each under its own
# time cap, every result written to $OUT (default outputs/gpu_checks/) as soon as it exists.
#
#   bash scripts/gpu/run_checks.sh env attention two_ranks            # about 6 minutes (estimated)
#   bash scripts/gpu/run_checks.sh one_rank profile fig15 compile     # about 6 minutes (estimated)
#   bash scripts/gpu/run_checks.sh tests train_debug train_modes      # about 5 minutes on an H100
#   bash scripts/gpu/run_checks.sh env overhead online                # about 7 minutes on an H100
#   REHEARSAL=1 OUT=/tmp/rehearsal bash scripts/gpu/run_checks.sh   # on a CPU, tiny sizes
#
# Python: WLB_PYTHON (default .venv/bin/python, else python3). On a machine without internet
# access, scripts/gpu/prepare.sh builds .gpu/site with what that Python lacks; it goes first on
# PYTHONPATH. LENGTHS: a length file for fig15, online and overhead (default
# .gpu/workloads/dist_wlbllm.json, DistCA's WLB-LLM length distribution, if present); without one
# they use the built-in generator `longtail`.
# Parts (default: all, in this order):
#   env          versions, the GPU, and an import of the trainer (fails fast on a broken install)
#   tests        tests/test_gpu.py: CUDA attention backends and CP ranks against the references
#   attention    tools.attention_bench: byte_1B at 64K on one GPU, the same documents and weights
#                under our document attention, TorchTitan's FlexAttention (block-causal) and causal
#                SDPA, eager and compiled: tokens/s, MFU, memory, losses -> $OUT/attention_bench.json
#   two_ranks    scripts/gpu/two_ranks.py: CP = 2 (per-document, hybrid) and PP = 2 as two ranks on
#                the one GPU over gloo against one process (losses, gradient norms of steps 1-3);
#                a layout gloo refuses also runs one step under TorchTitan's fake backend
#   one_rank     scripts/gpu/one_rank.py: rank 0 of llama3_8b_128k.toml and the paper's 7B/128K
#                layout, a few steps with fake collectives: peak memory and compute time per step
#                against the simulator's prediction for that rank (python -m torchtitan_wlb.sim.rank)
#   profile      the GPU's attention throughput table (tools.cp_profile, 7B heads, bf16) -> $OUT
#   fig15        Figure 15: one layer's attention under per-sequence / per-document / adaptive CP,
#                CP = 4, 128K, LENGTHS packed by wlb, adaptive deciding with that table
#   train_debug  ./run_train.sh as shipped (train_configs/debug_gpu.toml)
#   train_modes  byte_1B at 64K context in plain_4d, fixed_4d and wlb: tokens/s, MFU, memory, and
#                the metrics JSONL (measured micro-batch times) of each, as one archive
#   compile      ./run_train.sh (debug_gpu.toml) for 20 steps eager and with --compile.enable from
#                one seed: the first steps' losses side by side, graphs, recompiles, step times
#   online       the online cost model on the GPU: byte_1B at 32K, N = 8 micro-batches a step on
#                LENGTHS, wlb with the analytic and with the online model, and the noise floor
#                (identical micro-batches); metrics JSONL as one archive (scripts/gpu/online_report.py)
#   overhead     the data node's whole step on one pinned core of the host: pack_bench, N = 32,
#                128K, whole pass, every length file and generator, three rounds -> $OUT/overhead/
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
if [ -z "${WLB_PYTHON:-}" ]; then  # run_train.sh and run_tests.sh then install nothing
    WLB_PYTHON=python3
    [ -x "$ROOT/.venv/bin/python" ] && WLB_PYTHON="$ROOT/.venv/bin/python"
fi
export WLB_PYTHON
export PYTHONUNBUFFERED=1
PY=$WLB_PYTHON
LOG="$OUT/checks.log"
LENGTHS=${LENGTHS:-$GPU_DIR/workloads/dist_wlbllm.json}
SRC=(--generator longtail)  # fig15's documents: the length file, else the built-in generator
ATTN_SRC=(--generator longtail_scaled)  # attention's: the same, scaled from 128K to its context
if [ -f "$LENGTHS" ]; then
    SRC=(--lengths "$LENGTHS")
    ATTN_SRC=(--lengths "$LENGTHS" --lengths-context 131072)
fi

if [ "$REHEARSAL" = 1 ]; then  # the same commands at sizes a 2-core CPU runs in seconds
    DEVICE=cpu; HEADS=(--heads 2 --kv-heads 1 --head-dim 16); GRID=(--lengths 16,64,256,1024)
    FIG=(--context-len 4096 --micro-batches 4 --measure-micro-batches 4 --measure-repeats 1)
    TRAIN=(--model.flavor tiny --training.seq_len 1024 --training.global_batch_size 2)
    SMAX=1280; STEPS=3; CAPS=(60 120 120 120 240 300 300 300 300 120 300 120)
    ONE_RANK=(--rehearsal)
    export WLB_SHARED_DEVICE=1  # two_ranks: both CPU ranks on one device index, as on a GPU
    ATTN=(--device cpu --flavor tiny --context-len 512 --steps 3 --warmup 1
          --compile-backend aot_eager)  # Inductor cannot compile FlexAttention on a CPU
    COMPILE=(--model.flavor tiny --training.seq_len 256 --training.global_batch_size 2
             --training.steps 4)
    ONLINE=(--model.flavor tiny --training.seq_len 1024); ONLINE_CTX=1024; ONLINE_STEPS=8
else
    DEVICE=cuda; HEADS=(--heads 32 --kv-heads 8 --head-dim 128)
    GRID=(--repeats 2 --pairs-per-cell 268435456 --max-tokens 262144)
    FIG=(--context-len 131072 --micro-batches 4 --measure-micro-batches 12 --measure-repeats 2)
    TRAIN=(--model.flavor byte_1B --training.seq_len 65536 --training.global_batch_size 2
           --activation_checkpoint.mode full)
    SMAX=81920; STEPS=6; CAPS=(60 100 200 150 120 330 420 150 240 250 300 420)
    ONE_RANK=()
    ATTN=(--device cuda --flavor byte_1B --context-len 65536 --steps 6 --warmup 2)
    COMPILE=(--training.steps 20)  # train_configs/debug_gpu.toml as shipped
    ONLINE=(--model.flavor byte_1B --training.seq_len 32768 --activation_checkpoint.mode full)
    ONLINE_CTX=32768; ONLINE_STEPS=14
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
            --wlb.advanced.metrics_jsonl --metrics.log_freq 1 --metrics.disable_color_printing || rc=$?
    done
    tar -czf "$OUT/train_modes_metrics.tar.gz" -C "$WORK" \
        $(cd "$WORK" && find plain_4d fixed_4d wlb -name '*.jsonl' 2>/dev/null)
    return $rc
}

compile_check() {  # the trainer eager and compiled from one seed: first losses, graphs, step time
    local c rc=0
    for c in eager compiled; do
        echo "=== $c"
        NGPU=1 ./run_train.sh "${COMPILE[@]}" --debug.seed 7 \
            --checkpoint.no-enable --job.dump_folder "$WORK/compile_$c" \
            --wlb.advanced.metrics_jsonl --metrics.log_freq 1 --metrics.disable_color_printing \
            $([ $c = compiled ] && echo --compile.enable) || rc=$?
    done
    "$PY" - "$WORK" <<'PYEOF' || rc=1
import json
import sys
from pathlib import Path

import numpy as np

runs = {}
for c in ("eager", "compiled"):
    log = Path(sys.argv[1], f"compile_{c}", "wlb_metrics", "rank_0.jsonl")
    runs[c] = [json.loads(line) for line in log.open()]
for c, recs in runs.items():
    times = [r["wlb/step_time_s"] for r in recs[2:]]
    print(c, "losses 1-3", [round(r["loss"], 5) for r in recs[:3]],
          f"step 1 {recs[0]['wlb/step_time_s']:.2f} s, steps 3+ median {np.median(times):.3f} s",
          "graphs", recs[-1].get("wlb/compiled_graphs"), "recompiles", recs[-1].get("wlb/recompiles"))
rel = [abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(*runs.values())][:3]
print(json.dumps({"loss_rel_diff_steps_1_3": rel, "max": max(rel)}))
PYEOF
    return $rc
}

online() {  # N = 8 micro-batches a step, one GPU: their measured times are what DP or PP would wait on
    local run rc=0 fit=(--wlb.online.warmup_steps 1 --wlb.online.window_steps 4
                        --wlb.online.holdout_steps 1 --wlb.online.interval_steps 2
                        --wlb.online.apply_lag_steps 1)
    "$PY" - "$LENGTHS" "$WORK/online" "$ONLINE_CTX" "$ONLINE_STEPS" <<'PYEOF' || return 1
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np

from torchtitan_wlb.tools.e2e_bench import FLOOR, floor_doc_len, micro_batch_max_len, write_jsonl
from torchtitan_wlb.workloads import generate, load_lengths

workload, out, ctx, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
out.mkdir(parents=True, exist_ok=True)
source = load_lengths(workload) if Path(workload).is_file() else generate("longtail", 200_000, 131072)
lens = np.clip(np.rint(source * (ctx / 131072)).astype(np.int64), 3, ctx)
need = 1.5 * steps * 8 * ctx  # tokens: the steps asked for, with room for the queues' look-ahead
write_jsonl(lens[: int(np.searchsorted(np.cumsum(lens), need)) + 1], out / "docs.jsonl", 0)
f = floor_doc_len(lens, ctx)
write_jsonl(np.full(int(need // f) + 1, f), out / "floor.jsonl", 0)
smax = micro_batch_max_len(FLOOR, Namespace(context_len=ctx, smax_factor=1.25), f)
(out / "floor_smax").write_text(str(smax))  # room for exactly ctx // f documents, as e2e_bench
PYEOF
    for run in floor analytic online; do
        echo "=== $run"
        local data=docs.jsonl steps=$ONLINE_STEPS flags=(--wlb.mode wlb --wlb.cost_model "$run"
            --wlb.micro_batch_max_len $((ONLINE_CTX * 5 / 4)) "${fit[@]}")
        if [ $run = floor ]; then
            data=floor.jsonl steps=$((ONLINE_STEPS / 2))
            flags=(--wlb.mode "" --wlb.packing original --wlb.cp_sharding per_document
                   --wlb.micro_batch_max_len "$(cat "$WORK/online/floor_smax")")
        fi
        NGPU=1 ./run_train.sh "${ONLINE[@]}" --training.global_batch_size 8 "${flags[@]}" \
            --training.dataset jsonl --training.dataset_path "$WORK/online/$data" \
            --training.steps "$steps" --job.dump_folder "$WORK/online/$run" --checkpoint.no-enable \
            --lr_scheduler.warmup_steps 1 --wlb.advanced.metrics_jsonl --metrics.log_freq 1 \
            --metrics.disable_color_printing || rc=$?
    done
    tar -czf "$OUT/online_metrics.tar.gz" -C "$WORK/online" \
        $(cd "$WORK/online" && find floor analytic online -name '*.jsonl' 2>/dev/null)
    return $rc
}

overhead() {  # pack_bench's overhead_ms (docs/packing.md): a whole step of the data node
    local round w src pin=()
    lscpu 2>/dev/null | grep -E "Model name|^CPU\(s\)|MHz" || true
    command -v taskset >/dev/null && pin=(taskset -c 1)
    mkdir -p "$OUT/overhead"
    for round in 1 2 3; do
        for w in dist_wlbllm dist_prolong longtail pareto bimodal; do
            case $w in  # length files where present, the built-in generators always
                dist_*) [ -f "$GPU_DIR/workloads/$w.json" ] || continue
                        src=(--lengths "$GPU_DIR/workloads/$w.json") ;;
                *) src=(--generator "$w") ;;
            esac
            OMP_NUM_THREADS=1 "${pin[@]}" "$PY" -m torchtitan_wlb.tools.pack_bench "${src[@]}" \
                --micro-batches 32 --steps epoch --json >"$OUT/overhead/r${round}_$w.json" || return 1
            "$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], sys.argv[3],
    *(f'{k} {d[k]:.2f}' for k in ('overhead_ms', 'overhead_ms_p95', 'plan_ms')))" \
                "$OUT/overhead/r${round}_$w.json" "$round" "$w"
        done
    done
}

case "${1:-}" in  # a part that is a function runs in its own process, under `timeout`
    __env) env_check; exit $? ;;
    __train_modes) train_modes; exit $? ;;
    __compile) compile_check; exit $? ;;
    __online) online; exit $? ;;
    __overhead) overhead; exit $? ;;
esac
export GPU_DIR OUT WORK REHEARSAL
ALL=(env tests attention two_ranks one_rank profile fig15 train_debug train_modes compile online
     overhead)
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
        attention) part attention "${CAPS[9]}" "$PY" -m torchtitan_wlb.tools.attention_bench \
            "${ATTN[@]}" "${ATTN_SRC[@]}" --ac full --max-seconds 170 --profile \
            --runs wlb:eager,flex:eager,wlb:compiled,flex:compiled,sdpa:eager,sdpa:compiled \
            --out "$OUT/attention_bench.json" --json ;;
        two_ranks) part two_ranks "${CAPS[10]}" "$PY" scripts/gpu/two_ranks.py \
            --fake-backend always --work "$WORK/two_ranks" --out "$OUT/two_ranks.json" ;;
        one_rank) part one_rank "${CAPS[11]}" "$PY" scripts/gpu/one_rank.py "${ONE_RANK[@]}" \
            --out "$WORK/one_rank" && cp "$WORK/one_rank/one_rank.json" "$OUT/" ;;
        profile) part profile "${CAPS[2]}" "$PY" -m torchtitan_wlb.tools.cp_profile \
            --device "$DEVICE" "${HEADS[@]}" "${GRID[@]}" --out "$OUT/cp_profile_$DEVICE.json" ;;
        fig15) part fig15 "${CAPS[3]}" "$PY" -m torchtitan_wlb.tools.cp_bench "${SRC[@]}" \
            --cp 4 --packer wlb "${FIG[@]}" --measure --device "$DEVICE" "${HEADS[@]}" \
            --adaptive-candidates per_sequence,per_document \
            $([ -f "$OUT/cp_profile_$DEVICE.json" ] && echo --profile "$OUT/cp_profile_$DEVICE.json") \
            --no-torch-balancers --call-breakdown --json ;;
        train_debug) part train_debug "${CAPS[4]}" ./run_train.sh ;;
        train_modes) part train_modes "${CAPS[5]}" bash "$SELF" __train_modes ;;
        compile) part compile "${CAPS[8]}" bash "$SELF" __compile ;;
        online) part online "${CAPS[6]}" bash "$SELF" __online ;;
        overhead) part overhead "${CAPS[7]}" bash "$SELF" __overhead ;;
    esac
done
echo "== done $(date -u +%FT%TZ)" >>"$LOG"
cat "$LOG"
