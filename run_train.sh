#!/usr/bin/env bash
# Launch a torchtitan-wlb training run, TorchTitan style.
#
#   ./run_train.sh                                   # default config, all local GPUs or 2 CPU ranks
#   ./run_train.sh --training.steps 10               # any TorchTitan / [wlb] override passes through
#   CONFIG_FILE=train_configs/llama3_8b_128k.toml NGPU=8 ./run_train.sh
#   COMM_MODE=fake_backend NGPU=4 ./run_train.sh     # one step of rank 0 of NGPU ranks, one process
#   COMM_MODE=fake_backend NGPU=4 ./run_train.sh --training.steps 4   # four steps of it
#   ./run_train.sh --help                            # this text, then every config field
# A large layout (70B on 128 GPUs) is checked without computing a step by
#   python -m torchtitan_wlb.tools.dry_run CONFIG...
#
# Environment:
#   CONFIG_FILE  TOML config (default: train_configs/debug_gpu.toml with GPUs, debug_cpu.toml without)
#   NGPU         processes on this node (default: number of GPUs, or 2 CPU ranks)
#   LOG_RANK     ranks whose output is shown, comma-separated (default 0)
#   COMM_MODE    "fake_backend" or "local_tensor": one process computes rank 0 of NGPU ranks with
#                fake collectives (no checkpoint is loaded or saved), for 1 step unless
#                --training.steps is given; "local_tensor" builds the NGPU ranks' trainer and
#                stops there (TorchTitan trains no step in that mode)
#   TRAIN_FILE   module to run (default torchtitan_wlb.train)
#   WLB_SKIP_PREFLIGHT  set to skip the one-process check of config, data and checkpoint
# With no GPU the ranks are CPU processes talking over gloo; with GPUs, one process per GPU on NCCL.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"
source scripts/env.sh

GPUS=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    GPUS=$(nvidia-smi -L | grep -c '^GPU')
fi
if [ "$GPUS" -gt 0 ]; then
    DEFAULT_CONFIG="train_configs/debug_gpu.toml"; DEFAULT_NGPU=$GPUS
else
    DEFAULT_CONFIG="train_configs/debug_cpu.toml"; DEFAULT_NGPU=2
fi
CONFIG_FILE=${CONFIG_FILE:-$DEFAULT_CONFIG}
NGPU=${NGPU:-$DEFAULT_NGPU}
export LOG_RANK=${LOG_RANK:-0}
TRAIN_FILE=${TRAIN_FILE:-torchtitan_wlb.train}
COMM_MODE=${COMM_MODE:-""}

if [ ! -f "$CONFIG_FILE" ]; then
    echo "run_train.sh: CONFIG_FILE=$CONFIG_FILE does not exist (configs: $(ls train_configs/*.toml | tr '\n' ' '))" >&2
    exit 2
fi
if [[ " $* " == *" --help "* || " $* " == *" -h "* ]]; then
    sed -n '2,/^set -euo/p' "$0" | sed -n 's/^# \{0,1\}//p'
    exec "$PYTHON" -m "$TRAIN_FILE" --job.config_file "$CONFIG_FILE" --help
fi
if ! [[ "$NGPU" =~ ^[1-9][0-9]*$ ]]; then
    echo "run_train.sh: NGPU=$NGPU must be a positive integer" >&2
    exit 2
fi

if [ -n "$COMM_MODE" ]; then
    if [ "$COMM_MODE" != "fake_backend" ] && [ "$COMM_MODE" != "local_tensor" ]; then
        echo "run_train.sh: COMM_MODE=$COMM_MODE is not accepted; use fake_backend or local_tensor" >&2
        exit 2
    fi
    # Dry run: one process computes rank 0 of NGPU ranks with fake collectives, for one step
    # unless the arguments give --training.steps.
    STEPS=(--training.steps 1)
    for arg in "$@"; do
        case "$arg" in --training.steps|--training.steps=*) STEPS=() ;; esac
    done
    NGPU="$NGPU" LOCAL_RANK=0 exec "$PYTHON" -m "$TRAIN_FILE" --job.config_file "$CONFIG_FILE" \
        "$@" --comm.mode "$COMM_MODE" "${STEPS[@]}"
fi

if [ "$GPUS" -gt 0 ] && [ "$NGPU" -gt "$GPUS" ]; then
    echo "run_train.sh: NGPU=$NGPU but this node has $GPUS GPU(s); lower NGPU or use COMM_MODE=fake_backend for a dry run" >&2
    exit 2
fi
if [ "$GPUS" -eq 0 ]; then
    CORES=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc alone obeys OMP_NUM_THREADS
    if [ "$NGPU" -gt "$CORES" ] && [ -z "${WLB_ALLOW_OVERSUBSCRIBE:-}" ]; then
        echo "run_train.sh: NGPU=$NGPU CPU ranks but this machine has $CORES core(s); lower NGPU, or set WLB_ALLOW_OVERSUBSCRIBE=1" >&2
        exit 2
    fi
    # Share the cores between the ranks instead of letting each spawn a thread per core.
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CORES / NGPU > 0 ? CORES / NGPU : 1 ))}
fi

# --- pre-flight -------------------------------------------------------------------------------
# Check the config, the data source and the checkpoint a rerun would resume from once, with the
# arguments every rank will get, before torchrun starts any rank: a mistake is one line and exit
# status 2 here instead of a traceback from every rank. WLB_SKIP_PREFLIGHT=1 skips it.
if [ -z "${WLB_SKIP_PREFLIGHT:-}" ]; then
    NGPU="$NGPU" "$PYTHON" -m torchtitan_wlb.validate --job.config_file "$CONFIG_FILE" "$@" || exit $?
fi
# ----------------------------------------------------------------------------------------------

PYTORCH_ALLOC_CONF="expandable_segments:True" \
exec "$PYTHON" -m torch.distributed.run --nproc_per_node="$NGPU" --rdzv_backend c10d \
    --rdzv_endpoint="localhost:0" --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m "$TRAIN_FILE" --job.config_file "$CONFIG_FILE" "$@"
