#!/usr/bin/env bash
# Several devices on one machine: the layers split between the local device and a llama.cpp RPC server on
# loopback (ggml-rpc-server exposing the same GPU), dense vs sparse.
#
#   - correctness: `opencoti-patch lab multidevice rpc` (select-all = dense bitwise in the split layout, sparse split
#     vs sparse on one device, the selection runs, each device's side-cache matches the layers its KV holds, no
#     extra graph split), f16 and q8_0 KV -> LOG/multidevice-rpc{,-q8}.{json,md}
#   - speed: llama-bench decode with the split, dense vs sparse in one run -> LOG/rpc-bench.log
#
# Called by ci/device/h200.sh as its `rpc` stage (BIN, SRC, M8B, LOG, NGL, ROOT from there; the build has
# -DGGML_RPC=ON), after the `quality` stage (its python packages in $QW/site), or alone:
#   BIN=<build>/bin SRC=<tree> M8B=<model.gguf> LOG=<out dir> bash ci/device/rpc.sh
# RPC_DEPTHS (default 32768,131072): llama-bench depths; RPC_SPLIT (default "-ngl 99 -ts 1,1" on a GPU,
# "-ngl 2" on CPU, where the RPC device is the only offload target).
set -u
ROOT=${ROOT:-$(pwd)}
: "${BIN:?BIN: the bin folder of the build}" "${SRC:?SRC: its source tree}" "${M8B:?M8B: the GGUF model}"
: "${LOG:?LOG: the output folder}"
NGL=${NGL:-99}
QW=${OPENCOTI_QUALITY_WORK:-/tmp/ocw-quality}
RW=${OPENCOTI_RPC_WORK:-/tmp/ocw-rpc}
if [ "$NGL" -gt 0 ]; then
    SPLIT=${RPC_SPLIT:--ngl 99 -ts 1,1}; LOCAL="-ngl 99"; DEV=(--server-device CUDA0); BENCH_TS=(-ts 1/1)
else
    SPLIT=${RPC_SPLIT:--ngl 2}; LOCAL="-ngl 0"; DEV=(); BENCH_TS=()
fi
SERVER=$BIN/ggml-rpc-server
[ -x "$SERVER" ] || { echo "no $SERVER: build with -DGGML_RPC=ON, target ggml-rpc-server"; exit 1; }

# the package's python dependencies: quality.sh's env (click, jinja2, GitPython), or install its wheels
if ! PYTHONPATH=$QW/site python3 -c "import click, jinja2, git" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$QW/site" "$QW"/wheels/*.whl \
        "$ROOT"/.carry/wheels/quality/*.whl 2>/dev/null || true
fi
export PYTHONPATH=$QW/site:$ROOT GIT_PYTHON_REFRESH=quiet
opc() { python3 -c 'import sys; sys.argv[0] = "opencoti-patch"; from opencoti_patch.cli import main; main()' "$@"; }

# the correctness runs on a real model where one is here (quality.sh's Gemma 3 270M): on the random-weight 8B,
# sparse decode gave bitwise the dense logits on CUDA (2026-12-02), so "the selection changes the logits" could not
# be seen there; the speed runs stay on the 8B shape
CHECK_MODEL=${RPC_MODEL:-${OPENCOTI_GEMMA_DIR:-/tmp/ocw-gemma}/gemma-3-270m-q4_k_m.gguf}
[ -f "$CHECK_MODEL" ] || CHECK_MODEL=$M8B
rc=0
for kv in f16 q8_0; do
    name=multidevice-rpc; [ "$kv" = f16 ] || name=multidevice-rpc-q8
    opc lab multidevice rpc --build "$(dirname "$BIN")" --llama-src "$SRC" --model "$CHECK_MODEL" --split "$SPLIT" \
        --local "$LOCAL" "${DEV[@]}" --prompt-tokens "${RPC_PROMPT:-8192}" --ctx "${RPC_CTX:-12288}" \
        --decode 32 --topk 8 -t 4 --harness-arg "-ctk $kv -ctv $kv" --work-dir "$RW/$kv" --out-dir "$LOG" \
        --name "$name" || rc=1
done

# speed: the same split under llama-bench (its own -rpc / -ts syntax), dense and sparse in one run
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
dev=(); [ "$NGL" -gt 0 ] && dev=(-d CUDA0)
"$SERVER" -H 127.0.0.1 -p "$port" "${dev[@]}" > "$LOG/rpc-server-bench.log" 2>&1 &
spid=$!
for _ in $(seq 1 100); do
    python3 -c "import socket, sys; s = socket.socket(); sys.exit(s.connect_ex(('127.0.0.1', $port)))" && break
    sleep 0.2
done
"$BIN/llama-bench" -m "$M8B" -ngl "$NGL" -fa 1 -p 0 -n 64 -r 1 -o json -rpc "127.0.0.1:$port" "${BENCH_TS[@]}" \
    -d "${RPC_DEPTHS:-32768,131072}" -sa 0,1 -sak 32 > "$LOG/rpc-bench.log" 2> "$LOG/rpc-bench.err" || rc=1
kill "$spid" 2>/dev/null; wait "$spid" 2>/dev/null
exit $rc
