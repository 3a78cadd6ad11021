# Shared settings for turnstream's scripts. Sourced, never run.
# Heavy downloads live in a cache outside the checkout so that reruns (and CI on the same machine) are fast.
TURNSTREAM_CACHE="${TURNSTREAM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/turnstream}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$TURNSTREAM_CACHE"

log() { printf '[turnstream %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

# Wait until "$@" succeeds or the deadline (seconds) passes.
wait_for() {
    local deadline=$(( $(date +%s) + $1 )); shift
    until "$@" >/dev/null 2>&1; do
        (( $(date +%s) >= deadline )) && return 1
        sleep 0.3
    done
}
