#!/usr/bin/env bash
# Build .gpu/: what a lent GPU machine needs beside the working tree to run scripts/gpu/run_checks.sh.
#
# The GPU machines lent to this project have torch (2.11, CUDA 13), numpy, pandas, pyarrow,
# tensorboard, pytest, hypothesis, ... in their Python 3.12, but reach no package registry and do
# not get ../shared: what is missing travels with the working tree (the device tool's `carry`).
# Run this here, where PyPI is reachable, before a device session:
#
#   scripts/gpu/prepare.sh               # for the GPU machine's Python 3.12
#   GPU_DIR=/tmp/gpu311 scripts/gpu/prepare.sh 3.11   # for a CPU rehearsal under Python 3.11
#
# It writes GPU_DIR (default .gpu/, ignored by git):
#   site/       the packages the GPU image lacks (pip --target, no dependencies resolved there)
#   workloads/  the *.json length files of ../shared/workloads (public data of other projects:
#               carried, never committed)
# then: carry ".gpu" and run scripts/gpu/run_checks.sh there (docs/gpu.md).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [[ " $* " == *" --help "* || " $* " == *" -h "* ]]; then  # the header above, as text
    sed -n '2,/^set -/p' "${BASH_SOURCE[0]}" | sed -n 's/^# \{0,1\}//p'
    exit 0
fi
PYVER=${1:-3.12}
PY=${PYTHON:-$ROOT/.venv/bin/python}
GPU_DIR=${GPU_DIR:-$ROOT/.gpu}
WORKLOADS=${WORKLOADS:-$ROOT/../shared/workloads}
# torchtitan 0.2.2's and this project's requirements that the GPU image does not ship (its package
# list: the device tool's KINDS.md), pinned to the versions the CPU suite runs with.
PACKAGES=(
    torchtitan==0.2.2 torchdata==0.11.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
    tyro==1.0.17 typeguard==4.6.1 docstring-parser==0.18.0 highspy==1.16.0 tomli==2.5.0
    expecttest==0.3.0
)
if [ ! -f "$WORKLOADS/dist_wlbllm.json" ]; then
    echo "prepare.sh: $WORKLOADS has no dist_wlbllm.json (set WORKLOADS=folder)" >&2
    exit 2
fi
rm -rf "$GPU_DIR"
mkdir -p "$GPU_DIR/workloads"
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps --target "$GPU_DIR/site" \
    --python-version "$PYVER" --implementation cp --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 "${PACKAGES[@]}" 2> >(grep -v "is ignored: it is neither" >&2)
rm -rf "$GPU_DIR/site/bin"  # console scripts written for this interpreter
cp "$WORKLOADS"/*.json "$GPU_DIR/workloads/"
echo "built $GPU_DIR for Python $PYVER: $(du -sh "$GPU_DIR" | cut -f1)," \
    "$(find "$GPU_DIR/site" -maxdepth 1 -name '*.dist-info' | wc -l) packages," \
    "workloads: $(cd "$GPU_DIR/workloads" && echo *.json)"
