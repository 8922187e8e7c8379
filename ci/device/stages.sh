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
