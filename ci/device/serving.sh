#!/usr/bin/env bash
# The serving run on the GPU machine: llama-server with sparse attention on vs off, with its default slots
# (4, unified KV: `--parallel 4 -kvu`, what a plain `llama-server` does) and with `--parallel 4 --no-kv-unified`;
# 8K-32K prompts on the random 8B model, streamed and not, some streams cancelled. Checks per server (the load
# driver's, `opencoti-patch lab loadtest`): 0 transport errors, 0 HTTP 5xx, valid JSON, attribution, server
# RSS and GPU memory flat after warm-up, the server alive after the run; sparse vs dense tokens/s reported.
#
# Called by ci/device/h200.sh as its `serving` stage (BIN, M8B, LOG, SRC, BUILD, NGL from there), or alone:
#   BIN=<build>/bin M8B=<model.gguf> LOG=<out dir> bash ci/device/serving.sh
# It builds the llama-server target into BUILD first when BIN has none (the stage build leaves the server off).
#
# SERVING_REQUESTS (default 200) requests per server, SERVING_TIME_LIMIT (default 240) seconds of load per server
# (no request starts after it; the run then fails all_started: lower the requests), SERVING_LAYOUTS (default
# "unified perseq"), SERVING_MIN_TOKENS / SERVING_MAX_TOKENS (default 8192 / 32768), SERVING_CTX (total -c,
# default 4 x 33024), SERVING_NPREDICT (default 32). Results: LOG/serving-<layout>.json|md, server logs in
# LOG/serving-<layout>/.
set -u
ROOT=${ROOT:-$(pwd)}
: "${BIN:?BIN: the bin folder of the build}" "${M8B:?M8B: the GGUF model}" "${LOG:?LOG: the output folder}"
NGL=${NGL:-99}
REQUESTS=${SERVING_REQUESTS:-200}
TIME_LIMIT=${SERVING_TIME_LIMIT:-240}
LAYOUTS=${SERVING_LAYOUTS:-unified perseq}
MIN_TOKENS=${SERVING_MIN_TOKENS:-8192}
MAX_TOKENS=${SERVING_MAX_TOKENS:-32768}
CTX=${SERVING_CTX:-$((4 * 33024))}
NPREDICT=${SERVING_NPREDICT:-32}
PREFIX=$((MIN_TOKENS - 512)) # a shared prefix for half of the prompts (reused from the slot caches)

# shellcheck source=ci/device/stages.sh
source "$(dirname "$0")/stages.sh"
if [ ! -x "$BIN/llama-server" ]; then
    : "${BUILD:?BUILD: the build folder (no llama-server in BIN)}"
    ensure_llama_server "$BUILD" || exit 1
fi

# the package's python dependencies: the machine's python lacks GitPython (and may lack click and jinja2):
# the carried wheels (.carry/wheels, .carry/wheels/quality) go into a site folder of this run
SITE=${OPENCOTI_SERVING_SITE:-/tmp/ocw-serving/site}
if ! PYTHONPATH=$SITE python3 -c "import click, jinja2, git" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$ROOT"/.carry/wheels/*.whl \
        "$ROOT"/.carry/wheels/quality/*.whl 2>/dev/null || true
fi
export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH} GIT_PYTHON_REFRESH=quiet
opc() { python3 -c 'import sys; sys.argv[0] = "opencoti-patch"; from opencoti_patch.cli import main; main()' "$@"; }
rc=0
for layout in $LAYOUTS; do
    case $layout in
        unified) kv=-kvu ;;
        perseq)  kv=--no-kv-unified ;;
        *) echo "unknown layout $layout" >&2; exit 2 ;;
    esac
    mkdir -p "$LOG/serving-$layout"
    # the corpus is the prose of this repository's docs (the device has no documentation installed); a random-weight
    # model does not copy its context's key back, so the echo check is off and accepted as not checked by name (the
    # foreign marker and key checks still run on every answer)
    (cd "$ROOT" && opc lab loadtest --server "$BIN/llama-server" --model "$M8B" \
        --server-args="-ngl $NGL $kv" --parallel 4 --ctx "$CTX" --requests "$REQUESTS" --concurrency 8 \
        --shared-prefix-tokens "$PREFIX" --min-tokens "$MIN_TOKENS" --max-tokens "$MAX_TOKENS" \
        --n-predict "$NPREDICT" --isolated 2 --time-limit "$TIME_LIMIT" --min-key-echo 0 --accept-not-checked key_echo \
        --corpus docs \
        --variant dense="--sparse-attn off" --variant sparse="--sparse-attn on" \
        --compare sparse:dense \
        --json "$LOG/serving-$layout.json" --markdown "$LOG/serving-$layout.md" --log-dir "$LOG/serving-$layout") ||
        rc=1
done
exit $rc
