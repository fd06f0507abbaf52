#!/usr/bin/env bash
# Creates or reuses the project's Python environment; sourced by run_train.sh and run_tests.sh.
#
# Idempotent: the environment is (re)installed only when pyproject.toml changed since the last
# install (a stamp file holds its hash), so a second run installs nothing.
#
#   WLB_VENV=path     where the environment lives (default: .venv in the repository)
#   WLB_PYTHON=python use this interpreter as is and install nothing (bring-your-own env)
#
# CPU-only machines: torch==2.13.0 (the CPU build) is installed first, so pip never resolves the
# torch requirement to the multi-GB CUDA build. Machines with an NVIDIA GPU: the environment sees
# the system's site-packages, so an existing CUDA build of torch (>= 2.11) is reused.

_wlb_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [ -n "${WLB_PYTHON:-}" ]; then
    PYTHON="$WLB_PYTHON"
else
    _venv="${WLB_VENV:-$_wlb_root/.venv}"
    _stamp="$_venv/.wlb-installed"
    _want="$(sha256sum "$_wlb_root/pyproject.toml" | cut -d' ' -f1)"
    if [ ! -f "$_stamp" ] || [ "$(cat "$_stamp")" != "$_want" ]; then
        echo "[torchtitan-wlb] setting up the Python environment in $_venv" >&2
        _host_python="$(command -v python3.11 || command -v python3)"
        if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
            "$_host_python" -m venv --system-site-packages "$_venv"
            _extras="dev,sim"  # flash-attn: pip install -e ".[cuda]" (builds against your CUDA)
        else
            "$_host_python" -m venv "$_venv"
            "$_venv/bin/python" -m pip install -q --upgrade pip >/dev/null
            "$_venv/bin/python" -m pip install -q "torch==2.13.0" || {
                echo "[torchtitan-wlb] could not install torch==2.13.0" >&2; return 1 2>/dev/null || exit 1; }
            _extras="dev,sim"
        fi
        "$_venv/bin/python" -m pip install -q -e "$_wlb_root[$_extras]" || {
            echo "[torchtitan-wlb] pip install of the project failed" >&2; return 1 2>/dev/null || exit 1; }
        echo "$_want" > "$_stamp"
    fi
    PYTHON="$_venv/bin/python"
fi
export PYTHON
