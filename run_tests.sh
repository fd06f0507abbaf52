#!/usr/bin/env bash
# Run the lint checks and the test suite, creating or reusing the project's environment first.
#
#   ./run_tests.sh                 # ruff (lint + format check) and the whole pytest suite
#   ./run_tests.sh tests/test_x.py -k name    # arguments go to pytest
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"
source scripts/env.sh

if [ $# -eq 0 ]; then
    "$PYTHON" -m ruff check .
    "$PYTHON" -m ruff format --check .
fi
# Multi-process tests share the machine's cores: one BLAS thread per rank keeps them from
# oversubscribing (results do not depend on it).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PYTHON" -m pytest -q -p no:cacheprovider "$@"
