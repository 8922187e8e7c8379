#!/usr/bin/env bash
# The rebuild pipeline of the fork, stage by stage; .github workflow (ci/github/rebuild.yml) runs the
# same stages. Run it on every upstream bump or patch change:
#
#   ci/rebuild.sh [--cuda] [STAGE ...]        (no STAGE: all of them, in order)
#
# Stages: fetch backup apply markers verify rebuild optests publish
#   fetch     download (cached, sha256-checked) + extract the pinned upstream into the tree
#   backup    store the pristine tree and prove the backup intact
#   apply     apply patches/series onto the tree (one commit per patch on top of upstream/<pin>)
#   markers   every upstream-file change sits inside UPSTREAM_SYNC markers
#   verify    verify-identical: reproducible, byte-identical where untouched, same logits when off
#   rebuild   build + stamp the DSOs and tools, install + hash-check them into $ARTIFACTS/lib
#   optests   test-backend-ops -o SPARSE_ATTN_FILL / SPARSE_ATTN_SELECT, test-sparse-attn if built
#   publish   collect manifest, verify report and DSOs in $ARTIFACTS
#
# Environment: OPENCOTI (the command, default opencoti-patch), OPENCOTI_WORK (default ./work),
# ARTIFACTS (default $OPENCOTI_WORK/artifacts), JOBS (ninja -j), CUDA=1 (same as --cuda),
# CUDA_ARCH (default 90), VERIFY_ARGS / REBUILD_ARGS (extra arguments for those commands).
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
CUDA_ARCH=${CUDA_ARCH:-90}
ALL_STAGES=(fetch backup apply markers verify rebuild optests publish)

stages=()
for arg in "$@"; do
    case "$arg" in
        --cuda) CUDA=1 ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
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
BUILD_DIR=$OPENCOTI_WORK/build/$LABEL/build
TREE=${OPENCOTI_TREE:-$OPENCOTI_WORK/llama.cpp}

stage() {
    local t0=$SECONDS
    echo "::group::stage $1"
    "stage_$1"
    echo "::endgroup::"
    echo "stage $1: ok ($((SECONDS - t0)) s)"
}

stage_fetch()   { if [ -e "$TREE" ]; then echo "tree exists: $TREE (fetch skipped)"; else "$OC" fetch; fi; }
stage_backup()  { "$OC" backup; "$OC" backup --verify; }
stage_apply()   { "$OC" apply; }
stage_markers() { "$OC" markers --tree "$TREE"; }
stage_verify() {
    # shellcheck disable=SC2086
    "$OC" verify-identical "${GPU[@]}" "${JOBS_ARG[@]}" \
        --report-dir "$ARTIFACTS/verify-$LABEL" ${VERIFY_ARGS:-}
}
stage_rebuild() {
    # shellcheck disable=SC2086
    "$OC" rebuild "${GPU[@]}" "${JOBS_ARG[@]}" --label "$LABEL" \
        --install "$ARTIFACTS/lib-$LABEL" ${REBUILD_ARGS:-}
}
stage_optests() {
    local bin=$BUILD_DIR/bin ran=0
    if [ -x "$bin/test-backend-ops" ]; then
        for op in SPARSE_ATTN_FILL SPARSE_ATTN_SELECT FLASH_ATTN_EXT; do
            if "$bin/test-backend-ops" -o "$op" 2>&1 | tee "$BUILD_DIR/test-backend-ops-$op.log" | tail -3; then
                ran=1
            else
                echo "test-backend-ops -o $op FAILED"; return 1
            fi
        done
    fi
    if [ -x "$bin/test-sparse-attn" ]; then
        "$bin/test-sparse-attn"; ran=1
    fi
    [ "$ran" = 1 ] || echo "no op tests built (add test-backend-ops to the rebuild targets)"
}
stage_publish() {
    mkdir -p "$ARTIFACTS"
    cp "$BUILD_DIR"/opencoti-build-manifest.json "$BUILD_DIR"/opencoti-build-manifest.md "$ARTIFACTS/"
    cp "$BUILD_DIR"/test-backend-ops-*.log "$ARTIFACTS/" 2>/dev/null || true
    echo "artifacts in $ARTIFACTS:"; ls -la "$ARTIFACTS"
}

for s in "${stages[@]}"; do
    case " ${ALL_STAGES[*]} " in
        *" $s "*) stage "$s" ;;
        *) echo "unknown stage $s (one of: ${ALL_STAGES[*]})" >&2; exit 2 ;;
    esac
done
