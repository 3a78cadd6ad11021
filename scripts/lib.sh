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

# uv, bootstrapped once into the cache; prints its path. Both venvs (.venv, .venv-sglang) are made with it.
ensure_uv() {
    local python="${PYTHON:-python3.11}" home="$TURNSTREAM_CACHE/uv-tool"
    command -v "$python" >/dev/null || python=python3
    if [[ ! -x "$home/bin/uv" ]]; then
        log "bootstrapping uv into $home"
        "$python" -m venv "$home"
        "$home/bin/pip" install --quiet --disable-pip-version-check "uv==0.13.9"
    fi
    export UV_CACHE_DIR="$TURNSTREAM_CACHE/uv-cache" UV_LINK_MODE=copy
    printf '%s\n' "$home/bin/uv"
}
