#!/usr/bin/env bash
# Build .gpu/: what a GPU machine without internet access needs beside the checkout to run
# scripts/gpu/run_checks.sh (docs/gpu.md).
#
# The GPU machine's Python must already have torch with CUDA, numpy and pytest. This script
# downloads the rest (torchtitan 0.2.2 and the few packages it and this project need) as wheels for
# that Python, on a machine that reaches PyPI. Copy the checkout with .gpu/ to the GPU machine.
#
#   scripts/gpu/prepare.sh                                  # for a Python 3.12 GPU machine
#   GPU_DIR=/tmp/gpu311 scripts/gpu/prepare.sh 3.11         # for a CPU rehearsal under Python 3.11
#   WORKLOADS=~/lengths scripts/gpu/prepare.sh              # also copy length files
#
# It writes GPU_DIR (default .gpu/, ignored by git):
#   site/       the packages (pip --target, no dependencies resolved there)
#   workloads/  the *.json length files of WORKLOADS, if set (e.g. DistCA's dist_wlbllm.json, the
#               WLB-LLM length distribution; run_checks.sh reads it as its default LENGTHS)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [[ " $* " == *" --help "* || " $* " == *" -h "* ]]; then  # the header above, as text
    sed -n '2,/^set -/p' "${BASH_SOURCE[0]}" | sed -n 's/^# \{0,1\}//p'
    exit 0
fi
PYVER=${1:-3.12}
PY=${PYTHON:-$ROOT/.venv/bin/python}
GPU_DIR=${GPU_DIR:-$ROOT/.gpu}
WORKLOADS=${WORKLOADS:-}
# torchtitan 0.2.2's and this project's requirements beyond torch, numpy and pytest, pinned to the
# versions the CPU test suite runs with.
PACKAGES=(
    torchtitan==0.2.2 torchdata==0.11.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
    tyro==1.0.17 typeguard==4.6.1 docstring-parser==0.18.0 highspy==1.16.0 tomli==2.5.0
    expecttest==0.3.0
)
if [ -n "$WORKLOADS" ] && ! compgen -G "$WORKLOADS/*.json" >/dev/null; then
    echo "prepare.sh: WORKLOADS=$WORKLOADS holds no *.json length file" >&2
    exit 2
fi
rm -rf "$GPU_DIR"
mkdir -p "$GPU_DIR/workloads"
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps --target "$GPU_DIR/site" \
    --python-version "$PYVER" --implementation cp --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 "${PACKAGES[@]}" 2> >(grep -v "is ignored: it is neither" >&2)
rm -rf "$GPU_DIR/site/bin"  # console scripts written for this interpreter
if [ -n "$WORKLOADS" ]; then cp "$WORKLOADS"/*.json "$GPU_DIR/workloads/"; fi
echo "built $GPU_DIR for Python $PYVER: $(du -sh "$GPU_DIR" | cut -f1)," \
    "$(find "$GPU_DIR/site" -maxdepth 1 -name '*.dist-info' | wc -l) packages," \
    "workloads: $(cd "$GPU_DIR/workloads" && ls -- *.json 2>/dev/null | tr '\n' ' ')"
