#!/usr/bin/env bash
# Debian's redis-server on loopback, for development and CI.
#   scripts/redis.sh install|start|stop|status|reset
# Settings: REDIS_PORT (6379), TURNSTREAM_CACHE. Data (AOF, fsync every second) lives in the cache.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

REDIS_PORT="${REDIS_PORT:-6379}"
RUN="$TURNSTREAM_CACHE/redis/run-$REDIS_PORT"

install() {
    command -v redis-server >/dev/null && command -v redis-cli >/dev/null && return 0
    log "installing Debian's redis-server with apt"
    local sudo=""; [[ $(id -u) -ne 0 ]] && sudo="sudo"
    $sudo apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq redis-server >/dev/null \
        || die "apt-get install redis-server failed"
    # Debian's package starts a system service on 6379 where systemd runs; ours is separate and on loopback.
}

answers() { [[ "$(redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping 2>/dev/null)" == "PONG" ]]; }

start() {
    install
    if answers; then log "Redis already answering on 127.0.0.1:$REDIS_PORT"; return 0; fi
    umask 077  # its data is people's conversations: the owner's only
    mkdir -p "$RUN" && chmod 700 "$RUN"
    local t0; t0=$(date +%s%N)
    redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --protected-mode yes --daemonize yes \
        --dir "$RUN" --pidfile "$RUN/redis.pid" --logfile "$RUN/redis.log" \
        --appendonly yes --appendfsync everysec --save "" >/dev/null
    wait_for 20 answers || { tail -n 20 "$RUN/redis.log" >&2; die "Redis did not answer on 127.0.0.1:$REDIS_PORT"; }
    log "Redis $(redis-server --version | grep -o 'v=[0-9.]*' | cut -c3-) up on 127.0.0.1:$REDIS_PORT in $(( ($(date +%s%N) - t0) / 1000000 )) ms"
}

stop() {
    if answers; then
        redis-cli -h 127.0.0.1 -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true
        wait_for 10 bash -c "! redis-cli -h 127.0.0.1 -p $REDIS_PORT ping" || true
        log "Redis stopped"
    fi
}

case "${1:-start}" in
    install) install ;;
    start) start ;;
    stop) stop ;;
    status) answers ;;
    reset) stop; rm -rf "$RUN" ;;
    *) die "usage: $0 install|start|stop|status|reset" ;;
esac
