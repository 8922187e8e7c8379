#!/usr/bin/env bash
# The H200 side of the benchmark and CUDA test pipeline (issue: decode benchmark on the H200).
#
# The device machine is bare and offline, and one command may run at most 10 minutes, so the work
# runs detached (`start`) and is polled (`wait`), and results are copied into $OUT.
#
#   ci/device/h200.sh start [STAGES...]     extract + patch + build, write models, run stages (detached)
#   ci/device/h200.sh pipeline [STAGES...]  the README's main job on this machine, `ci/rebuild.sh --cuda`
#                                           (fetch .. verify, rebuild, optests, publish), then the
#                                           stages on the pipeline's own CUDA build (detached)
#   ci/device/h200.sh resume [STAGES...]    on a warm machine: the carried tree over the built one (only the files
#                                           whose content changed), incremental build, the stages; as start on a
#                                           fresh machine
#   ci/device/h200.sh wait SECONDS          print progress until done or SECONDS pass; copy results to $OUT
#
# Inputs (carried in the working tree): .carry/llama-src.tar.gz, a slim pinned tree (top folder
# llama.cpp/) with the patch series already applied, or pristine plus patches/series to apply here.
# `lab bench pack` stamps it with the digest of patches/: start and resume refuse a tree packed beside another
# state of the series (pack again; OPENCOTI_ALLOW_STALE_TREE=1 builds it anyway).
# `pipeline` instead: .carry/llama-pristine.tar.gz (`opencoti-patch lab bench pack --rev upstream/<pin>
# --out .carry/llama-pristine.tar.gz`: the machine cannot download the pinned sdist) and
# .carry/wheels/ (GitPython, gitdb, smmap: the one dependency the machine's python lacks).
# Stages (default: tests bench budgets bench-q8 bench-14b): also bench-b32 (the bench budget in 32-token blocks),
# bench-pp (llama-bench pp512 after BENCH_PP_DEPTHS cells, default 32768,65536, dense and sparse), perf, batched,
# rebuild-cost, test-fa-all, serving,
# quality (ci/device/quality.sh fg: the selector's quality on real prose, Gemma 3 270M), batched4,
# batched8 (llama-batched-bench B = 4 and 8 at BATCHED8_NPP cells each, unified and per sequence),
# rpc (layers split between CUDA0 and a ggml-rpc-server on loopback, ci/device/rpc.sh),
# profile (a kernel timeline of llama-bench at each of PROFILE_DEPTHS, default 131072, dense and sparse, and with
# PROFILE_PP="off on" of a prompt of PROFILE_PP_NPP tokens, default 32768: kernel-trace.cpp + kernel_profile.py),
# longctx (decode at a synthetic depth, LONGCTX_CASES "KV:DEPTH ..." default "f16:131072 f16:524288 q8_0:1048576",
# dense and sparse (LONGCTX_TOPK x LONGCTX_BLOCK, default 32 x 128, block score LONGCTX_SCORE, default maxmean),
# traced: the harness's --synthetic-depth tiles a 4096-token prompt's state to the depth; `lab bench report` reads the
# JSONs as model "8b-synth")
# (PROFILE_DEPTHS=" " leaves the decode timelines out)
# (BENCH_DEPTHS: the depths of the bench stage, default 0,8192,16384,32768,65536,131072; BENCH_ARGS: more llama-bench
# arguments for it, e.g. "-sadt 0,1": the layer rule off and on, and dense twice, which shows the run-to-run spread;
# "-sap 16,4 -sasc max,maxmean": the key-sum page size and block score side by side, one dense row)
# (SERVING_SHAPE: the serving stage's model, default 1b, used when OPENCOTI_SHAPES wrote it)
# selbench (ci/device/select-bench.cu: the fused select against the floor kernels of
# ci/device/candidates/select-floor.patch and the memory floor of the key sums, at SELBENCH_DEPTHS cases
# N_KV[:PAGE[:SCORE[:N_BATCH]]], default "32768:4 131072:16 524288:16 1048576:16 131072:16:maxmean:4"; fails when the
# block lists differ), bench-nofloor and longctx-nofloor (the sparse rows of bench / longctx with
# GGML_CUDA_SPARSE_SELECT_FLOOR=0: the fused select in the same build, for the floor candidate's A/B; longctx-nofloor
# writes $LOG/nofloor/, run nofloor/longctx of `bench report`); the tests stage also runs test-select-nofloor (SELECT
# with the fused kernel where the floor kernels would run)
# CANDIDATES: patch files (paths in the working tree, space-separated) applied with `git apply` over the carried tree
# by start and resume: a change to try on the GPU before it joins the series, e.g.
# CANDIDATES=ci/device/candidates/NAME.patch (resume with the same list keeps it applied; see ci/device/candidates/README.md)
set -u
ROOT=$(pwd)
W=${OPENCOTI_DEVICE_WORK:-/tmp/ocw}
LOG=$W/log
SRC=$W/llama.cpp
BUILD=$W/build
BIN=$BUILD/bin
CUDA=${OPENCOTI_DEVICE_CUDA:-1}          # 0: CPU-only dry run of this script on a developer machine
SHAPES=${OPENCOTI_SHAPES:-8b 14b}        # random-weight models to write (opencoti_patch.verify.synth_gguf)
M8B=${OPENCOTI_M8B:-$W/m-8b-q4_0.gguf}
M14B=${OPENCOTI_M14B:-$W/m-14b-q4_0.gguf}
NGL=99; BACKEND=CUDA0; GPU_FLAG=--cuda; PIPE_LABEL=cuda
[ "$CUDA" = 1 ] || { NGL=0; BACKEND=CPU; GPU_FLAG=; PIPE_LABEL=cpu; }

# shellcheck source=ci/device/stages.sh
source "$(dirname "$0")/stages.sh"

prepare_src() {
    mkdir -p "$W"
    tar xzf "$ROOT/.carry/llama-src.tar.gz" -C "$W"
    if [ -f "$ROOT/.carry/APPLY_SERIES" ]; then
        (cd "$SRC" && while read -r p; do
            case "$p" in ''|'#'*) continue;; esac
            # the applier of the stack: git apply (exact, no fuzz); no repository above $SRC is used
            GIT_CEILING_DIRECTORIES=$W git apply --whitespace=nowarn "$ROOT/patches/$p" || exit 1
        done < "$ROOT/patches/series") || return 1
    fi
    apply_candidates "$SRC"
}

apply_candidates() { # $1: an extracted tree; the CANDIDATES patches over it, in order, exact (no fuzz)
    local c
    for c in ${CANDIDATES:-}; do
        echo "candidate: $c"
        (cd "$1" && GIT_CEILING_DIRECTORIES=$(dirname "$1") git apply --whitespace=nowarn "$ROOT/$c") || {
            echo "candidate $c does not apply" >&2; return 1; }
    done
}

update_src() { # the carried tree over the one built here, rewriting only files whose content changed (ninja
    # then rebuilds what they feed, not everything: a fresh extract would give every file a new mtime)
    local new=$W/llama.cpp.new
    rm -rf "$new"; mkdir -p "$new"
    tar xzf "$ROOT/.carry/llama-src.tar.gz" -C "$new" || return 1
    apply_candidates "$new/llama.cpp" || return 1
    python3 - "$new/llama.cpp" "$SRC" <<'PY'
import filecmp, os, shutil, sys
new, old = sys.argv[1], sys.argv[2]
changed = 0
for d, _, files in os.walk(new):
    for f in files:
        a = os.path.join(d, f)
        b = os.path.join(old, os.path.relpath(a, new))
        if not os.path.exists(b) or not filecmp.cmp(a, b, shallow=False):
            os.makedirs(os.path.dirname(b), exist_ok=True)
            shutil.copy2(a, b)
            os.utime(b)  # newer than the objects built from the old text
            changed += 1
            print("changed:", os.path.relpath(a, new))
print(changed, "files changed")
PY
    rm -rf "$new"
}

build_cuda() {
    local gen=() cuda=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90)
    command -v ninja >/dev/null && gen=(-G Ninja)
    [ "$CUDA" = 1 ] || cuda=(-DGGML_NATIVE=OFF -DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
    # llama-server in the same build when a stage needs it (BUILD_SERVER=1: no reconfigure later); no UI download
    local server=OFF targets=(llama-bench llama-batched-bench test-backend-ops test-sparse-attn-kv ggml-rpc-server)
    [ "${BUILD_SERVER:-0}" = 1 ] && { server=ON; targets+=(llama-server); }
    cmake -S "$SRC" -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release "${cuda[@]}" \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=$server -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_RPC=ON &&
    # shellcheck disable=SC2086
    cmake --build "$BUILD" -j "$(nproc)" --target "${targets[@]}" ${EXTRA_TARGETS:-}
}

needs_server() { # stages...: true when one of them runs llama-server (serving, or quality with its served stage)
    local s
    for s in "$@"; do
        [ "$s" = serving ] && return 0
        [ "$s" = quality ] && [[ " ${QUALITY_STAGES:-} " == *" served "* ]] && return 0
    done
    return 1
}

write_models() {
    export PYTHONPATH=$ROOT
    for shape in $SHAPES; do
        [ -s "$W/m-$shape-q4_0.gguf" ] && continue # written by an earlier run on this machine (resume)
        python3 -m opencoti_patch.verify.synth_gguf "$W/m-$shape-q4_0.gguf" --shape "$shape" --type q4_0 --tree "$SRC" || return 1
    done
}

perf_ops() { # the per-op timings of the sparse ops (test-backend-ops perf)
    run_stage perf-ops  "$BIN/test-backend-ops" perf -o SPARSE_ATTN_SELECT -b $BACKEND
    run_stage perf-fill "$BIN/test-backend-ops" perf -o SPARSE_ATTN_FILL -b $BACKEND
    run_stage perf-fa   "$BIN/test-backend-ops" perf -o FLASH_ATTN_EXT -p block_size -b $BACKEND
}

build_tracer() { # the CUPTI tracer of ci/device/kernel-trace.cpp (the machine has no nsys)
    local home lib="" inc="" d
    home=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")}
    for d in "$home/extras/CUPTI/lib64" "$home/lib64" "$home/targets/x86_64-linux/lib" "$home/lib"; do
        [ -e "$d/libcupti.so" ] && { lib=$d; break; }
    done
    for d in "$home/extras/CUPTI/include" "$home/include" "$home/targets/x86_64-linux/include"; do
        [ -e "$d/cupti.h" ] && { inc=$d; break; }
    done
    [ -n "$lib" ] && [ -n "$inc" ] || { echo "CUPTI not found under $home"; return 1; }
    g++ -std=c++17 -O2 -shared -fPIC -I"$inc" "$ROOT/ci/device/kernel-trace.cpp" -L"$lib" -lcupti \
        -Wl,-rpath,"$lib" -o "$W/libkernel-trace.so"
}

build_harness_single() { # the logits harness of the package (opencoti-harness) against this build
    cmake -S "$ROOT/opencoti_patch/harness" -B "$W/harness" -DCMAKE_BUILD_TYPE=Release -DLLAMA_SRC="$SRC" \
        -DLLAMA_BIN="$BIN" && cmake --build "$W/harness" -j "$(nproc)" --target opencoti-harness
}

traced() { # name cmd...: run cmd under the tracer, then the per-step profile into $LOG/name.{md,json}
    local name=$1; shift
    CUDA_INJECTION64_PATH=$W/libkernel-trace.so OPENCOTI_TRACE_OUT=$W/trace-$name.tsv "$@" &&
    python3 "$ROOT/ci/device/kernel_profile.py" "$W/trace-$name.tsv" --json "$LOG/$name.json" > "$LOG/$name.md"
}

profile() { # name model args...: llama-bench decode under the tracer
    local name=$1 model=$2; shift 2
    traced "$name" "$BIN/llama-bench" -m "$model" -ngl $NGL -fa 1 -p 0 -n 32 -r 1 -o json "$@"
}

bench() { # name model args...
    local name=$1 model=$2; shift 2
    run_stage "$name" "$BIN/llama-bench" -m "$model" -ngl $NGL -fa 1 -p 0 -n 64 -o json "$@"
}

pipeline_env() {
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$W/site" "$ROOT"/.carry/wheels/*.whl || return 1
    mkdir -p "$W/pristine" "$W/bin"
    tar xzf "$ROOT/.carry/llama-pristine.tar.gz" -C "$W/pristine" || return 1
    printf '#!/bin/sh\nexec python3 -c "import sys; sys.argv[0] = %s; from opencoti_patch.cli import main; sys.exit(main())" "$@"\n' \
        "'opencoti-patch'" > "$W/bin/opencoti-patch"
    chmod +x "$W/bin/opencoti-patch"
}

# the main job, stage by stage (its own log each); verify may FAIL and the pipeline goes on, so that the
# report and the later stages still come back
pipeline() {
    export PYTHONPATH=$W/site:$ROOT OPENCOTI=$W/bin/opencoti-patch OPENCOTI_WORK=$W/work OPENCOTI_CACHE=$W/cache
    export ARTIFACTS=$W/artifacts JOBS=$(nproc) FETCH_ARGS="--from $W/pristine/llama.cpp"
    local s
    for s in fetch backup apply markers; do
        run_stage "pipe-$s" bash ci/rebuild.sh $GPU_FLAG "$s" || return 1
    done
    run_stage pipe-verify bash ci/rebuild.sh $GPU_FLAG verify
    run_stage pipe-rebuild bash ci/rebuild.sh $GPU_FLAG rebuild || return 1
}

longctx_cases() { # sub modes...: the LONGCTX_CASES decoded at a synthetic depth in each mode (off: dense, on: sparse),
    # traced; the harness JSONs in $LOG/<sub>/ (a run of its own for `bench report`), in $LOG/ for sub ""
    local sub=$1; shift
    local out=$LOG${sub:+/$sub} tag=${sub:+$sub-} c sa
    mkdir -p "$out"
    run_stage longctx-harness build_harness_single || return 1
    local tracer=0; run_stage build-tracer build_tracer && tracer=1
    for c in ${LONGCTX_CASES:-f16:131072 f16:524288 q8_0:1048576}; do
        local kv=${c%%:*} d=${c##*:} k=${LONGCTX_TOPK:-32} b=${LONGCTX_BLOCK:-128}
        local sc=${LONGCTX_SCORE:-maxmean}
        for sa in "$@"; do
            # the name carries what `bench report` needs: KV type, depth, dense or top-k x block and score
            local name=longctx-$kv-$d-dense; [ "$sa" = on ] && name=longctx-$kv-$d-k$k-b$b-$sc
            local cmd=("$W/harness/opencoti-harness" -m "$M8B" -ngl $NGL -fa on -ctk "$kv" -ctv "$kv" -t 8
                --prompt-tokens 4096 --synthetic-depth "$d" --decode "${LONGCTX_DECODE:-40}" --warmup 8
                --sparse-attn "$sa" --sparse-attn-topk "$k" --sparse-attn-block-size "$b"
                --sparse-attn-score "$sc" --json "$out/$name.json")
            if [ $tracer = 1 ]; then run_stage "$tag$name" traced "$tag$name-profile" "${cmd[@]}"
            else run_stage "$tag$name" "${cmd[@]}"; fi
        done
    done
}

start() {
    needs_server "$@" && export BUILD_SERVER=1
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$LOG/gpu.txt" 2>&1
    nvcc --version >> "$LOG/gpu.txt" 2>&1
    if [ "${MODE:-}" = pipeline ]; then
        run_stage pipe-env pipeline_env || return 1
        SRC=$W/pristine/llama.cpp # gguf-py for the models
        write_models > "$LOG/models.log" 2>&1 &
        local models_pid=$!
        pipeline || { echo "$(date +%T) ALL DONE (pipeline failed)" >> "$LOG/status"; return 1; }
        BUILD=$OPENCOTI_WORK/verify-$PIPE_LABEL/patched/build; BIN=$BUILD/bin
        run_stage build-extra cmake --build "$BUILD" --target llama-batched-bench ${EXTRA_TARGETS:-}
        run_stage pipe-optests bash ci/rebuild.sh $GPU_FLAG optests
        run_stage pipe-publish bash ci/rebuild.sh $GPU_FLAG publish
    elif [ "${MODE:-}" = resume ]; then # the machine's build and models are kept: the changed sources only
        run_stage update update_src || return 1
        write_models > "$LOG/models.log" 2>&1 & # only the shapes not written yet
        local models_pid=$!
        run_stage build build_cuda || return 1
    else
        run_stage prepare prepare_src || return 1
        write_models > "$LOG/models.log" 2>&1 &
        local models_pid=$!
        run_stage build build_cuda || return 1
    fi
    wait $models_pid; echo "models rc=$?" >> "$LOG/status"
    local stages=("$@")
    [ ${#stages[@]} -eq 0 ] && stages=(tests bench budgets bench-q8 bench-14b)
    for s in "${stages[@]}"; do
        case $s in
        tests)
            run_stage test-fill   "$BIN/test-backend-ops" -o SPARSE_ATTN_FILL -b $BACKEND
            run_stage test-select "$BIN/test-backend-ops" -o SPARSE_ATTN_SELECT -b $BACKEND
            # the fused select kernel where the floor kernels would run (its fallback: no cp.async, shared memory)
            GGML_CUDA_SPARSE_SELECT_FLOOR=0 run_stage test-select-nofloor "$BIN/test-backend-ops" -o SPARSE_ATTN_SELECT \
                -b $BACKEND
            run_stage test-fa-sparse "$BIN/test-backend-ops" -o FLASH_ATTN_EXT -p block_size -b $BACKEND
            run_stage test-kv     "$BIN/test-sparse-attn-kv" -g
            perf_ops ;;
        perf) # per-op timings only (the pipeline's optests already ran the correctness cases)
            perf_ops ;;
        rebuild-cost)
            run_stage rebuild-f16 "$BIN/test-sparse-attn-kv" -g --bench 131072 f16 32
            run_stage rebuild-q8  "$BIN/test-sparse-attn-kv" -g --bench 131072 q8_0 32 ;;
        test-fa-all)
            run_stage test-fa     "$BIN/test-backend-ops" -o FLASH_ATTN_EXT -b $BACKEND ;;
        bench)
            # shellcheck disable=SC2086  # BENCH_ARGS: more llama-bench arguments (words), e.g. "-sadt 0,1"
            bench bench-f16 "$M8B" -r 2 -d "${BENCH_DEPTHS:-0,8192,16384,32768,65536,131072}" -sa 0,1 -sak 32 ${BENCH_ARGS:-} ;;
        bench-nofloor) # the sparse rows of bench with the fused select (GGML_CUDA_SPARSE_SELECT_FLOOR=0): the floor select's
            # candidate against the tree's kernel in one build (run it right after bench, same machine)
            # shellcheck disable=SC2086
            GGML_CUDA_SPARSE_SELECT_FLOOR=0 bench bench-nofloor-f16 "$M8B" -r 2 \
                -d "${BENCH_DEPTHS:-0,8192,16384,32768,65536,131072}" -sa 1 -sak 32 ${BENCH_ARGS:-} ;;
        batched)
            # the normal decode path with a real prefill; B = 4 sequences in one unified stream (each its own selection)
            for sa in off on; do
                run_stage "batched-$sa" "$BIN/llama-batched-bench" -m "$M8B" -ngl $NGL -fa on -c 140000 -b 2048 -ub 512 \
                    -npp 32768,131072 -ntg 64 -npl 1 --sparse-attn $sa
                run_stage "batched4-$sa" "$BIN/llama-batched-bench" -m "$M8B" -ngl $NGL -fa on -c 140000 -b 2048 -ub 512 \
                    -npp 16384,32768 -ntg 64 -npl 4 --kv-unified --sparse-attn $sa
            done ;;
        budgets)
            bench bench-budgets "$M8B" -r 2 -d 131072 -sa 1 -sak 8,16 ;;
        bench-pp) # prompt processing at a depth: one 512-token ubatch timed after the depth's prefill, dense and sparse
            run_stage bench-pp "$BIN/llama-bench" -m "$M8B" -ngl $NGL -fa 1 -p 512 -n 0 -o json -r 3 \
                -d "${BENCH_PP_DEPTHS:-32768,65536}" -sa 0,1 ;;
        bench-b32) # the bench stage's 4096-token top-k budget in 32-token blocks (128 x 32), sparse only
            bench bench-b32 "$M8B" -r 2 -d "${BENCH_B32_DEPTHS:-32768,131072}" -sa 1 -sab 32 -sak 128 ;;
        bench-q8)
            bench bench-q8 "$M8B" -r 2 -ctk q8_0 -ctv q8_0 -d 32768,131072 -sa 0,1 -sak 32 ;;
        bench-14b)
            bench bench-14b "$M14B" -r 2 -d "${BENCH14_DEPTHS:-32768,131072}" -sa 0,1 -sak 32 ;;
        profile)
            run_stage build-tracer build_tracer || continue
            for d in ${PROFILE_DEPTHS:-131072}; do
                run_stage "profile-8b-$d" profile "profile-8b-$d" "$M8B" -d "$d" -sa 0,1 -sak 32
            done
            # prompt processing (real prefill, one sequence) with sparse attention off and on
            local npp=${PROFILE_PP_NPP:-32768}
            for sa in ${PROFILE_PP:-}; do
                run_stage "profile-pp-$sa" traced "profile-pp-$sa" "$BIN/llama-batched-bench" -m "$M8B" -ngl $NGL \
                    -fa on -c $((npp + 256)) -b 2048 -ub 512 -npp "$npp" -ntg 8 -npl 1 --sparse-attn "$sa"
            done ;;
        quality) # the selector's quality (ci/device/quality.sh inputs + receive first), alone on the GPU
            # shellcheck disable=SC2086
            run_stage quality bash "$ROOT/ci/device/quality.sh" fg ${QUALITY_STAGES:-} ;;
        batched4)
            # B = 4 sequences in one unified stream only (each its own selection; the per-sequence min-ctx rule)
            for sa in off on; do
                run_stage "batched4-$sa" "$BIN/llama-batched-bench" -m "$M8B" -ngl $NGL -fa on -c 140000 -b 2048 -ub 512 \
                    -npp "${BATCHED4_NPP:-16384,32768}" -ntg 64 -npl 4 --kv-unified --sparse-attn $sa
            done ;;
        batched8)
            # B = 4 and 8 sequences at BATCHED8_NPP (default 32768) cells each, unified stream and one stream per sequence
            local layout
            for layout in unified perseq; do
                local kvu=--kv-unified; [ $layout = perseq ] && kvu=--no-kv-unified
                for sa in off on; do
                    run_stage "batched8-$layout-$sa" "$BIN/llama-batched-bench" -m "$M8B" -ngl $NGL -fa on \
                        -c "${BATCHED8_CTX:-270000}" -b 2048 -ub 512 -npp "${BATCHED8_NPP:-32768}" -ntg 64 -npl 4,8 \
                        $kvu --sparse-attn $sa
                done
            done ;;
        serving) # the load test on the SERVING_SHAPE model (default 1b) when OPENCOTI_SHAPES wrote it, else the 8B
            local sm=$M8B; [ -f "$W/m-${SERVING_SHAPE:-1b}-q4_0.gguf" ] && sm=$W/m-${SERVING_SHAPE:-1b}-q4_0.gguf
            run_stage serving env BIN="$BIN" M8B="$sm" LOG="$LOG" BUILD="$BUILD" NGL=$NGL ROOT="$ROOT" bash ci/device/serving.sh ;;
        longctx) # decode at 128K-1M cells without the prefill (the harness's --synthetic-depth: a 4096-token
            # prompt's K/V tiled to the depth through the state API), dense and sparse, under the kernel tracer
            longctx_cases "" off on ;;
        longctx-nofloor) # the sparse rows of longctx with the fused select (GGML_CUDA_SPARSE_SELECT_FLOOR=0), in
            # $LOG/nofloor/ (`bench report` run nofloor/longctx): the floor select's candidate against the tree's kernel,
            # one build, one machine
            GGML_CUDA_SPARSE_SELECT_FLOOR=0 longctx_cases nofloor on ;;
        selbench) # the fused select against the floor kernels (ci/device/candidates/select-floor.patch) and the
            # memory floor, score phase and top-k timed apart (L2 cold and warm); fails when their block lists differ
            run_stage selbench-build nvcc -std=c++17 -O3 -arch=sm_90 -use_fast_math -extended-lambda -DNDEBUG \
                -I"$SRC/ggml/include" -I"$SRC/ggml/src" -I"$SRC/ggml/src/ggml-cuda" "$ROOT/ci/device/select-bench.cu" \
                -L"$BIN" -lggml-cuda -lggml-base -lggml -Xlinker -rpath -Xlinker "$BIN" -o "$W/select-bench" &&
            # shellcheck disable=SC2086  # SELBENCH_DEPTHS: cases N_KV[:PAGE[:SCORE[:N_BATCH]]] (words)
            run_stage selbench "$W/select-bench" ${SELBENCH_DEPTHS:-32768:4 131072:16 524288:16 1048576:16 131072:16:maxmean:4} ;;
        rpc) # layers split between CUDA0 and an RPC server on loopback (ci/device/rpc.sh)
            run_stage rpc env BIN="$BIN" SRC="$SRC" M8B="$M8B" LOG="$LOG" NGL=$NGL ROOT="$ROOT" bash ci/device/rpc.sh ;;
        *) echo "unknown stage $s" >> "$LOG/status" ;;
        esac
    done
    echo "$(date +%T) ALL DONE" >> "$LOG/status"
}

collect() {
    [ -n "${OUT:-}" ] || return 0
    mkdir -p "$OUT"
    # the pipeline's reports, manifest and test logs (not its DSOs)
    if [ -d "$W/artifacts" ]; then
        (cd "$W/artifacts" && find . -type f \( -name '*.md' -o -name '*.json' -o -name '*.log' \) -size -4M \
            -exec cp --parents {} "$LOG/artifacts/" \;) 2>/dev/null || true
    fi
    local f
    for f in "$W"/work/verify-*/*/runs/*.log "$W"/work/verify-*/*/build/opencoti-build.log; do
        [ -f "$f" ] || continue
        local rel=${f#"$W"/work/}
        mkdir -p "$LOG/work/$(dirname "$rel")"
        tail -n 300 "$f" > "$LOG/work/$rel"
    done
    (cd "$W" && tar czf "$OUT/results.tgz" log 2>/dev/null)
    [ -d "${OPENCOTI_QUALITY_WORK:-/tmp/ocw-quality}/log" ] && bash "$ROOT/ci/device/quality.sh" collect
    return 0
}

wait_for() {
    local limit=$1 t0=$SECONDS t_collect=$SECONDS
    while [ $((SECONDS - t0)) -lt "$limit" ]; do
        if grep -q "ALL DONE" "$LOG/status" 2>/dev/null; then break; fi
        # a failed prepare/build ends the run: do not wait out the limit
        if grep -Eq "end (prepare|build|pipe-env) rc=[1-9]" "$LOG/status" 2>/dev/null; then break; fi
        # what is done so far is in $OUT even if this call is cut short (device time running out)
        if [ $((SECONDS - t_collect)) -ge 60 ]; then collect; t_collect=$SECONDS; fi
        sleep 5
    done
    cat "$LOG/status" 2>/dev/null
    tail -n 3 "$LOG/build.log" 2>/dev/null
    collect
}

RUN_PID=$W.pid # the detached run's session leader (outside $W, which start empties)

refuse_if_in_flight() { # two runs on one machine would build and measure over each other
    local pid; pid=$(cat "$RUN_PID" 2>/dev/null) || return 0
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        echo "h200.sh: a run is still in flight on this machine (pid $pid; $LOG/status):" \
             "'$0 wait SECONDS' follows it, 'kill -- -$pid' stops it" >&2
        exit 1
    fi
}

launch() { # the detached run of the stages: _run, in its own session, its pid kept
    setsid nohup bash "$0" _run "$@" > "$W/run.log" 2>&1 < /dev/null &
    echo $! > "$RUN_PID"
}

series_digest() { # patches/series and the patches it lists, in its order: opencoti_patch.stack.series.series_digest
    local digest
    digest=$(set -o pipefail; (cd "$ROOT/patches" && cat series && sed -e 's/#.*//' -e 's/^[[:space:]]*//' \
        -e 's/[[:space:]]*$//' series | grep -v '^$' | while read -r p; do cat "$p" || exit 1; done) | sha256sum) ||
        return 1
    echo "${digest%% *}"
}

refuse_stale_tree() { # a carried tree packed beside another state of patches/ would build and measure the old series
    local tarball=$ROOT/.carry/llama-src.tar.gz stamp want
    [ -f "$tarball" ] && [ -f "$ROOT/patches/series" ] && [ ! -f "$ROOT/.carry/APPLY_SERIES" ] || return 0
    stamp=$(tar xzf "$tarball" -O llama.cpp/.opencoti-series.sha256 2>/dev/null) || {
        echo "h200.sh: $tarball has no series stamp (packed before stamps): cannot tell whether it is the series" \
             "of patches/; pack it again (opencoti-patch lab bench pack)" >&2
        return 0
    }
    want=$(series_digest) || { echo "h200.sh: cannot read patches/series or a patch it lists" >&2; exit 1; }
    if [ "$stamp" != "$want" ] && [ "${OPENCOTI_ALLOW_STALE_TREE:-0}" != 1 ]; then
        echo "h200.sh: $tarball was packed beside another state of patches/ (stamp ${stamp:0:12}, patches/ now" \
             "${want:0:12}): it would build the old series. Pack it again (opencoti-patch lab bench pack), or set" \
             "OPENCOTI_ALLOW_STALE_TREE=1 to build it anyway" >&2
        exit 1
    fi
}

case ${1:-} in
    start|pipeline|resume) refuse_if_in_flight ;;
esac
case ${1:-} in
    start|resume) refuse_stale_tree ;;
esac
case ${1:-} in
    start) shift; rm -rf "$W"; mkdir -p "$LOG"; launch "$@" ;;
    pipeline) shift; rm -rf "$W"; mkdir -p "$LOG/artifacts"; MODE=pipeline launch "$@" ;;
    resume) shift # a warm machine: keep $W (build, models, logs), update the sources, rebuild incrementally
        if [ -f "$BUILD/build.ninja" ] || [ -f "$BUILD/Makefile" ]; then
            mkdir -p "$LOG/prev"; mv "$LOG"/*.* "$LOG/prev/" 2>/dev/null; : > "$LOG/status"
            MODE=resume launch "$@"
        else # a fresh machine: as start
            rm -rf "$W"; mkdir -p "$LOG"; launch "$@"
        fi ;;
    _run)  shift; start "$@" ;;
    wait)  wait_for "${2:-540}" ;;
    quality) shift; exec bash "$(dirname "$0")/quality.sh" "$@" ;;  # the selector's quality: ci/device/quality.sh
    *) echo "usage: $0 start [stages...] | resume [stages...] | pipeline [stages...] | wait SECONDS" >&2; exit 2 ;;
esac
