#!/usr/bin/env bash
# The rebuild pipeline of the fork, stage by stage; the GitHub workflow (.github/workflows/rebuild.yml) runs the
# same stages. Run it on every upstream bump or patch change:
#
#   ci/rebuild.sh [--cuda] [STAGE ...]        (no STAGE: all of them, in order)
#   ci/rebuild.sh [--cuda] --to PIN           the upstream bump, one command to run again after each
#                                             stop: pin add PIN (if new; PIN_ARGS, default --pypi PIN)
#                                             -> `bump PIN` (the old pin's tree -> rebase --to PIN with
#                                             marker-aware auto-resolution -> snapshot; run again after a
#                                             conflict it continues the rebase) -> check (patch by patch:
#                                             build + each patch's Test: lines) -> optests -> verify ->
#                                             rebuild + stamp -> publish. A conflict stops it (exit 3)
#                                             leaving $ARTIFACTS/bump-PIN/ with the rebase report
#                                             (rebase.json, rebase.txt) and the conflicted files
#                                             (conflicted/<path>): resolve them in the tree and run it
#                                             again. A patch that does not build or pass its tests stops
#                                             it (exit 4; check.json) naming the patch: fix it in the
#                                             tree, `snapshot --into NNNN-name.patch`, run it again.
#
# Stages: fetch backup apply markers verify rebuild optests publish
#   fetch     download (cached, sha256-checked) + extract the pinned upstream into the tree
#   backup    store the pristine tree and prove the backup intact
#   apply     apply patches/series onto the tree (one commit per patch on top of upstream/<pin>)
#   markers   every upstream-file change sits inside UPSTREAM_SYNC markers
#   verify    verify-identical: reproducible, byte-identical where untouched, same logits when off
#   rebuild   build + stamp the DSOs and tools, install + hash-check them into $ARTIFACTS/lib
#   optests   test-sparse-attn + test-sparse-attn-kv (all cases) from a non-DL build; with --cuda also
#             test-backend-ops CUDA vs CPU for the sparse ops (device only)
#   publish   collect manifest, verify report and DSOs in $ARTIFACTS
#
# The rebuild stage builds in verify-identical's patched build folder (same flags, same sources): the
# libraries are compiled once per pipeline run, and the tools and the stamp are added on top.
#
# Environment: OPENCOTI (the command, default opencoti-patch), OPENCOTI_WORK (default ./work),
# ARTIFACTS (default $OPENCOTI_WORK/artifacts), JOBS (ninja -j), CUDA=1 (same as --cuda),
# CUDA_ARCH (default 90-real), FETCH_ARGS / VERIFY_ARGS / REBUILD_ARGS (extra arguments for those
# commands; e.g. FETCH_ARGS="--from DIR" on a machine that cannot download: see docs/usage.md).
set -euo pipefail

if [ -z "${OPENCOTI:-}" ]; then
    # first use after cloning: a venv with this package (same as ci/test.sh)
    VENV=${OPENCOTI_VENV:-.venv}
    if [ ! -x "$VENV/bin/opencoti-patch" ]; then
        [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
        "$VENV/bin/python" -m pip install -q -e .
    fi
    OPENCOTI=$VENV/bin/opencoti-patch
fi
OC=$OPENCOTI
export OPENCOTI_WORK=${OPENCOTI_WORK:-$PWD/work}
ARTIFACTS=${ARTIFACTS:-$OPENCOTI_WORK/artifacts}
CUDA=${CUDA:-0}
CUDA_ARCH=${CUDA_ARCH:-90-real}
ALL_STAGES=(fetch backup apply markers verify rebuild optests publish)

TO_PIN=""
rest=()
while [ $# -gt 0 ]; do
    case "$1" in
        --to) [ $# -ge 2 ] || { echo "--to needs a pin" >&2; exit 2; }; TO_PIN=$2; shift 2 ;;
        --to=*) TO_PIN=${1#--to=}; shift ;;
        *) rest+=("$1"); shift ;;
    esac
done
set -- "${rest[@]+"${rest[@]}"}"

stages=()
for arg in "$@"; do
    case "$arg" in
        --cuda) CUDA=1 ;;
        -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
        *) stages+=("$arg") ;;
    esac
done
[ ${#stages[@]} -eq 0 ] && stages=("${ALL_STAGES[@]}")

if [ "$CUDA" = 1 ]; then
    GPU=(--cuda --cuda-arch "$CUDA_ARCH"); LABEL=cuda
else
    GPU=(--no-cuda); LABEL=cpu
fi
JOBS_ARG=()
[ -n "${JOBS:-}" ] && JOBS_ARG=(-j "$JOBS")
VERIFY_ROOT=$OPENCOTI_WORK/verify-$LABEL
BUILD_DIR=$VERIFY_ROOT/patched/build
TREE=${OPENCOTI_TREE:-$OPENCOTI_WORK/llama.cpp}

stage() {
    local t0=$SECONDS
    echo "::group::stage $1"
    "stage_$1"
    echo "::endgroup::"
    echo "stage $1: ok ($((SECONDS - t0)) s)"
}

# shellcheck disable=SC2086
stage_fetch()   { if [ -e "$TREE" ]; then echo "tree exists: $TREE (fetch skipped)"; else "$OC" fetch ${FETCH_ARGS:-}; fi; }
stage_backup()  { "$OC" backup; "$OC" backup --verify; }
stage_apply()   { "$OC" apply; }
stage_markers() { "$OC" markers --tree "$TREE"; }
stage_verify() {
    # The series patches ggml.h, which every library and nearly every object reads: the binaries stage
    # cannot tell an expected difference from an unexpected one, and the report says "not checked".
    # Accepted here by name; sources, reproducibility and behaviour must PASS.
    # shellcheck disable=SC2086
    "$OC" verify-identical "${GPU[@]}" "${JOBS_ARG[@]}" --accept-not-checked binaries \
        --verify-root "$VERIFY_ROOT" --report-dir "$ARTIFACTS/verify-$LABEL" ${VERIFY_ARGS:-}
}
stage_rebuild() {
    # shellcheck disable=SC2086
    "$OC" rebuild "${GPU[@]}" "${JOBS_ARG[@]}" --build-root "$VERIFY_ROOT" --label patched \
        --install "$ARTIFACTS/lib-$LABEL" ${REBUILD_ARGS:-}
}
stage_optests() {
    local bin=$BUILD_DIR/bin
    mkdir -p "$BUILD_DIR"  # its logs go beside the pipeline's build (the bump runs it before verify)
    if [ "$CUDA" = 1 ]; then
        # CUDA against the CPU backend, op by op (the sparse FA cases carry block_size in their name).
        # Device only: on a CPU-only build test-backend-ops would compare the CPU backend with itself.
        local op
        for op in SPARSE_ATTN_FILL SPARSE_ATTN_SELECT FLASH_ATTN_EXT; do
            local filter=()
            [ "$op" = FLASH_ATTN_EXT ] && filter=(-p block_size)
            "$bin/test-backend-ops" test -b CUDA0 -o "$op" "${filter[@]}" 2>&1 \
                | tee "$BUILD_DIR/test-backend-ops-$op.log" | tail -3
            [ "${PIPESTATUS[0]}" = 0 ] || { echo "test-backend-ops -o $op FAILED"; return 1; }
            grep -Eq '[1-9][0-9]*/[0-9]+ tests passed' "$BUILD_DIR/test-backend-ops-$op.log" \
                || { echo "test-backend-ops -o $op ran no test"; return 1; }
        done
        # the side-cache on the GPU after every KV-cache operation, select-all bitwise equal to dense
        kv_cases "$bin/test-sparse-attn-kv" -g "$BUILD_DIR/test-sparse-attn-kv-cuda.log" || return 1
    fi
    # The CPU kernels against references that do not share their code (test-sparse-attn: sparse FA vs
    # masked dense FA, the ops vs naive loops) and the key-sum side-cache after every KV-cache
    # operation (test-sparse-attn-kv, all cases). Both link the CPU backend directly: a non-DL build.
    # shellcheck disable=SC2086
    "$OC" rebuild --no-cuda "${JOBS_ARG[@]}" --label selfcheck --targets test-sparse-attn,test-sparse-attn-kv \
        --cmake-arg -DGGML_BACKEND_DL=OFF --cmake-arg -DLLAMA_BUILD_TESTS=ON
    local sbin=$OPENCOTI_WORK/build/selfcheck/build/bin
    "$sbin/test-sparse-attn" 2>&1 | tee "$BUILD_DIR/test-sparse-attn.log" | tail -2
    [ "${PIPESTATUS[0]}" = 0 ] || return 1
    kv_cases "$sbin/test-sparse-attn-kv" "" "$BUILD_DIR/test-sparse-attn-kv.log"
}
kv_cases() { # exe [flag] log: every one of the 32 cases of test-sparse-attn-kv must say OK
    local n_ok
    # shellcheck disable=SC2086
    "$1" $2 2>&1 | tee "$3" | tail -3
    [ "${PIPESTATUS[0]}" = 0 ] || { echo "test-sparse-attn-kv $2 FAILED"; return 1; }
    n_ok=$(grep -Ec '^(llama|multi-seq|threshold|gemma3-iswa) hd=.* OK( |$)' "$3")
    [ "$n_ok" = 32 ] || { echo "test-sparse-attn-kv $2: $n_ok of 32 cases OK"; return 1; }
}
stage_publish() {
    mkdir -p "$ARTIFACTS"
    cp "$BUILD_DIR"/opencoti-build-manifest.json "$BUILD_DIR"/opencoti-build-manifest.md "$ARTIFACTS/"
    cp "$BUILD_DIR"/test-backend-ops-*.log "$BUILD_DIR"/test-sparse-attn*.log "$ARTIFACTS/" 2>/dev/null || true
    echo "artifacts in $ARTIFACTS:"; ls -la "$ARTIFACTS"
}

# -- the upstream bump (--to PIN) ---------------------------------------------------------------
# Every stop leaves the tree as it is; the same command goes on from there (`bump` looks at the tree).
stage_bump() {
    local out=$ARTIFACTS/bump-$TO_PIN rc=0
    mkdir -p "$out"
    if ! "$OC" pin list --json | python3 -c "import json,sys; sys.exit(0 if any(p['name'] == '$TO_PIN' for p in json.load(sys.stdin)['pins']) else 1)"; then
        # shellcheck disable=SC2086
        "$OC" pin add "$TO_PIN" ${PIN_ARGS:---pypi $TO_PIN}
    fi
    # shellcheck disable=SC2086
    "$OC" bump "$TO_PIN" ${FETCH_ARGS:-} --json > "$out/rebase.json" || rc=$?
    python3 - "$out/rebase.json" > "$out/rebase.txt" <<'PY' || true
import json, sys
text = open(sys.argv[1]).read()
data = json.loads(text[text.index("{"):])
for step in data.get("steps", []):
    print(f"- {step}")
for o in data["outcomes"]:
    print(f"{o['status']:<14} {o['patch']}")
    for r in o.get("resolved", []):
        print(f"    auto-resolved {r['file']}:{r['lines']} ({', '.join(r['rules'])})")
    for x in o.get("left", []):
        print(f"    left          {x['file']}:{x['lines']}: {x['why']}")
PY
    cat "$out/rebase.txt"
    if [ "$rc" != 0 ]; then
        rm -rf "$out/conflicted"
        (cd "$TREE" && git diff --name-only --diff-filter=U 2>/dev/null) | while read -r f; do
            mkdir -p "$out/conflicted/$(dirname "$f")"; cp "$TREE/$f" "$out/conflicted/$f"
        done
        echo "bump onto $TO_PIN stopped (exit $rc; $out): resolve in $TREE, then run" \
             "ci/rebuild.sh --to $TO_PIN again (it continues the rebase)" >&2
        return "$rc"
    fi
}
stage_check() { # the series patch by patch: apply, build, the patch's Test: lines
    local out=$ARTIFACTS/bump-$TO_PIN rc=0
    mkdir -p "$out"
    "$OC" check --no-cuda "${JOBS_ARG[@]}" --json > "$out/check.json" || rc=$?
    if [ "$rc" != 0 ]; then
        echo "check of the series on $TO_PIN failed (exit $rc; $out/check.json): fix the patch named above" \
             "in $TREE, capture the fix with \`$OC snapshot --into NNNN-name.patch\`, then run" \
             "ci/rebuild.sh --to $TO_PIN again" >&2
        return "$rc"
    fi
}

if [ -n "$TO_PIN" ]; then
    for s in bump check optests verify rebuild publish; do stage "$s"; done
    echo "bump onto $TO_PIN done: the rebased series built and passed its tests patch by patch, the C++" \
         "tests, verify-identical; stamped build and manifest in $ARTIFACTS"
    exit 0
fi

for s in "${stages[@]}"; do
    case " ${ALL_STAGES[*]} " in
        *" $s "*) stage "$s" ;;
        *) echo "unknown stage $s (one of: ${ALL_STAGES[*]})" >&2; exit 2 ;;
    esac
done
