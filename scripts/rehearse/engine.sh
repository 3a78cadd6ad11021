#!/usr/bin/env bash
# A Docker engine and the compose plugin for the rehearsal (scripts/rehearse.sh), apart from anything else on the
# machine: the daemon this script starts keeps its data, state and socket under $TURNSTREAM_CACHE/docker.
#   bash scripts/rehearse/engine.sh start   use a daemon that answers at $DOCKER_HOST or the system socket; else start ours (installing
#                                           Debian's docker.io when dockerd is missing); build the plugin (cached)
#   bash scripts/rehearse/engine.sh env     print the exports a caller needs: eval "$(bash ... env)"
#   bash scripts/rehearse/engine.sh stop    stop the daemon this script started
#
# The compose plugin is Docker Compose v2.40.3 built with Go from the Go module proxy (Docker's release binaries
# cannot be downloaded here) through a wrapper module in scripts/rehearse/compose-plugin: `go install ...@v2.40.3`
# refuses a module whose go.mod has exclude directives, so the wrapper requires compose at its own requirement
# versions and repeats its excludes. Docker CLI finds it in $DOCKER_CONFIG/cli-plugins.
#
# Builds use the engine's classic builder (DOCKER_BUILDKIT=0): Debian's docker.io has no buildx plugin, the
# rehearsal builds with `docker build`, and the Dockerfile needs nothing BuildKit-only.
set -euo pipefail
source "$(dirname "$0")/../lib.sh"

COMPOSE_VERSION="$(sed -n 's/^require github.com\/docker\/compose\/v2 \(v[0-9.]*\)$/\1/p' \
    "$REPO_ROOT/scripts/rehearse/compose-plugin/go.mod")"
ROOT="$TURNSTREAM_CACHE/docker"
SOCK="$ROOT/docker.sock"
OUR_HOST="unix://$SOCK"
PLUGINS="$ROOT/config/cli-plugins"

SYSTEM_HOST="unix:///var/run/docker.sock"

exports() {  # the daemon to use: $DOCKER_HOST's, else a system daemon's, else ours
    local host="${DOCKER_HOST:-}"
    if [[ -z "$host" ]] || ! DOCKER_HOST="$host" docker info >/dev/null 2>&1; then
        if ! answers "$OUR_HOST" && answers "$SYSTEM_HOST"; then host="$SYSTEM_HOST"; else host="$OUR_HOST"; fi
    fi
    printf 'export DOCKER_HOST=%q DOCKER_CONFIG=%q DOCKER_BUILDKIT=0 COMPOSE_BAKE=false\n' "$host" "$ROOT/config"
}

answers() { DOCKER_HOST="$1" docker info >/dev/null 2>&1; }

start_daemon() {
    if [[ -n "${DOCKER_HOST:-}" ]] && answers "$DOCKER_HOST"; then
        log "using the Docker daemon at $DOCKER_HOST"; return 0
    fi
    if answers "$OUR_HOST"; then log "Docker daemon already running at $OUR_HOST"; return 0; fi
    if answers "$SYSTEM_HOST"; then log "using the system's Docker daemon at $SYSTEM_HOST"; return 0; fi
    if ! command -v dockerd >/dev/null; then
        log "installing Debian's docker.io (dockerd, containerd, runc)"
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io >/dev/null \
            || die "apt-get install docker.io failed"
    fi
    mkdir -p "$ROOT/data" "$ROOT/exec" "$ROOT/config"
    # Debian's package would start a system daemon where systemd runs; ours is separate: its own paths and socket,
    # and its own bridge name so a system docker0 is left alone.
    log "starting dockerd (data $ROOT/data, socket $SOCK)"
    if ! ip link show turnstream0 >/dev/null 2>&1; then
        ip link add turnstream0 type bridge && ip addr add 172.31.250.1/24 dev turnstream0 && ip link set turnstream0 up
    fi
    nohup dockerd --data-root "$ROOT/data" --exec-root "$ROOT/exec" --pidfile "$ROOT/dockerd.pid" \
        -H "$OUR_HOST" --bridge turnstream0 --storage-driver overlay2 >"$ROOT/dockerd.log" 2>&1 &
    wait_for 120 docker -H "$OUR_HOST" info || { tail -30 "$ROOT/dockerd.log" >&2; die "dockerd did not answer"; }
    log "Docker $(docker -H "$OUR_HOST" version --format '{{.Server.Version}}') answering at $OUR_HOST"
}

build_plugin() {
    local bin="$ROOT/compose-$COMPOSE_VERSION"
    if [[ ! -x "$bin" ]]; then
        command -v go >/dev/null || PATH="$PATH:/usr/local/go/bin"
        command -v go >/dev/null || die "Go is needed to build the compose plugin"
        log "building Docker Compose $COMPOSE_VERSION from the Go module proxy (once; a few minutes)"
        (cd "$REPO_ROOT/scripts/rehearse/compose-plugin" && CGO_ENABLED=0 go build -trimpath -ldflags \
            "-s -w -X github.com/docker/compose/v2/internal.Version=$COMPOSE_VERSION" \
            -o "$bin.tmp" github.com/docker/compose/v2/cmd) && mv "$bin.tmp" "$bin"
    fi
    mkdir -p "$PLUGINS"
    ln -sf "$bin" "$PLUGINS/docker-compose"
}

case "${1:-start}" in
    start)
        start_daemon
        build_plugin
        eval "$(exports)"
        log "$(docker compose version)"
        ;;
    env) exports ;;
    stop)
        if [[ -f "$ROOT/dockerd.pid" ]] && kill "$(cat "$ROOT/dockerd.pid")" 2>/dev/null; then
            log "stopping dockerd"
            wait_for 60 sh -c "! kill -0 $(cat "$ROOT/dockerd.pid") 2>/dev/null" || true
        fi
        if ip link show turnstream0 >/dev/null 2>&1 && ! answers "$OUR_HOST"; then  # the bridge start made
            ip link del turnstream0
        fi
        ;;
    *) die "usage: engine.sh [start|env|stop]" ;;
esac
