# Sourced by ci/device/h200.sh and ci/device/quality.sh: the stages of a detached run, each with its own log
# ($LOG/<name>.log) and a line in $LOG/status when it begins and ends (what the `wait` commands poll).
stage_begin() { echo "$(date +%T) begin $1" >> "$LOG/status"; }
stage_end()   { echo "$(date +%T) end $1 rc=$2" >> "$LOG/status"; }

run_stage() { # name cmd...
    local name=$1; shift
    stage_begin "$name"
    ( set -o pipefail; "$@" ) > "$LOG/$name.log" 2>&1
    local rc=$?
    stage_end "$name" $rc
    return $rc
}

ensure_llama_server() { # build: the llama-server target of that build when its bin/ has none (stage builds leave it off)
    [ -x "$1/bin/llama-server" ] && return 0
    # the slim tree carries tools/ui; no UI download or build (an offline machine)
    # `cmake .` inside the build folder: its cached source tree (a plain -B would take the current directory)
    (cd "$1" && cmake . -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF) &&
        cmake --build "$1" -j "$(nproc)" --target llama-server
}
