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

# pip, condensed: on a terminal, one line that updates in place (the package being collected, the
# download's percentage); elsewhere only the summary. The full output is kept in $_venv/pip.log,
# whose tail is shown if pip fails. Needs pip >= 24.1 (--progress-bar raw): upgraded first.
_wlb_pip() {
    "$_venv/bin/python" -m pip install --progress-bar raw "$@" 2>&1 | tee -a "$_venv/pip.log" \
        | _wlb_pip_progress
    local status=${PIPESTATUS[0]}
    if [ "$status" -ne 0 ]; then
        tail -n 15 "$_venv/pip.log" >&2
    fi
    return "$status"
}

_wlb_pip_progress() {
    local line what="" tty=0 done total file size
    [ -t 2 ] && tty=1
    while IFS= read -r line; do
        case "$line" in
            "Collecting "*) what="collecting ${line#Collecting }" ;;
            *"Downloading "*)  # "Downloading torch-2.13.0+cpu-cp311-...whl (187.3 MB)"
                file="${line##*Downloading }"; size="${file#"${file%% *}"}"; file="${file%% *}"
                what="downloading $(echo "$file" | cut -d- -f1,2)$size" ;;
            "Progress "*" of "*)
                read -r _ done _ total <<< "$line"
                if [ "${total:-0}" -gt 0 ] && [ "$tty" = 1 ]; then
                    printf '\r\033[K[torchtitan-wlb] %.80s %3d%%' "$what" $((done * 100 / total)) >&2
                fi
                continue ;;
            "Installing collected packages: "*) what="installing $(echo "${line#*: }" | tr -cd ',' | wc -c | awk '{print $1 + 1}') packages" ;;
            "Successfully installed "*)
                [ "$tty" = 1 ] && printf '\r\033[K' >&2
                echo "[torchtitan-wlb] installed $(echo "${line#Successfully installed }" | wc -w) package(s)" >&2
                continue ;;
            *) continue ;;
        esac
        [ "$tty" = 1 ] && printf '\r\033[K[torchtitan-wlb] %.90s' "$what" >&2
    done
    [ "$tty" = 1 ] && printf '\r\033[K' >&2
    return 0
}

if [ -n "${WLB_PYTHON:-}" ]; then
    PYTHON="$WLB_PYTHON"
else
    _venv="${WLB_VENV:-$_wlb_root/.venv}"
    _stamp="$_venv/.wlb-installed"
    _want="$(sha256sum "$_wlb_root/pyproject.toml" | cut -d' ' -f1)"
    if [ ! -f "$_stamp" ] || [ "$(cat "$_stamp")" != "$_want" ]; then
        echo "[torchtitan-wlb] setting up the Python environment in $_venv (first time: a few minutes; log: $_venv/pip.log)" >&2
        _host_python="$(command -v python3.11 || command -v python3)"
        if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
            "$_host_python" -m venv --system-site-packages "$_venv"
            "$_venv/bin/python" -m pip install -q --progress-bar off --upgrade pip >>"$_venv/pip.log" 2>&1
            _extras="dev,sim"  # flash-attn: pip install -e ".[cuda]" (builds against your CUDA)
        else
            "$_host_python" -m venv "$_venv"
            "$_venv/bin/python" -m pip install -q --progress-bar off --upgrade pip >>"$_venv/pip.log" 2>&1
            _wlb_pip "torch==2.13.0" || {
                echo "[torchtitan-wlb] could not install torch==2.13.0 (log: $_venv/pip.log)" >&2; return 1 2>/dev/null || exit 1; }
            _extras="dev,sim"
        fi
        _wlb_pip -e "$_wlb_root[$_extras]" || {
            echo "[torchtitan-wlb] pip install of the project failed (log: $_venv/pip.log)" >&2; return 1 2>/dev/null || exit 1; }
        echo "$_want" > "$_stamp"
    fi
    PYTHON="$_venv/bin/python"
fi
export PYTHON
