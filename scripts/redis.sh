#!/usr/bin/env bash
# Debian's redis-server on loopback, for development and CI.
#   scripts/redis.sh install|start|stop|status|reset
#   scripts/redis.sh url        the URL that logs in as its operator, admin: redis://admin:<password>@127.0.0.1:<port>/0
# Settings: REDIS_PORT (6379), TURNSTREAM_CACHE. Data (AOF, fsync every second) lives in the cache.
# As the deployments run it (runtime/security/redis_users.py): the default user off, `probe` (any password) may only
# PING (health checks); everything else logs in. `turnstream run` makes each service a user of its own through admin; admin's password is
# made once per data folder (secrets, 0600).
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

answers() { [[ "$(redis-cli --user probe --pass probe -h 127.0.0.1 -p "$REDIS_PORT" ping 2>/dev/null)" == "PONG" ]] \
    || [[ "$(redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping 2>/dev/null)" == "PONG" ]]; }  # ours, or an older one
secret() { grep "^admin=" "$RUN/secrets" 2>/dev/null | cut -d= -f2; }
admin() { redis-cli --no-auth-warning --user admin --pass "$(secret)" -h 127.0.0.1 -p "$REDIS_PORT" "$@"; }
ours() { [[ "$(admin ping 2>/dev/null)" == "PONG" ]]; }  # started by this script, with its users
make_secret() {
    [[ -f "$RUN/secrets" ]] && return 0
    printf 'admin=%s\n' "$(head -c 18 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=')" >"$RUN/secrets"
    chmod 600 "$RUN/secrets"
}

start() {
    install
    if answers; then
        ours || die "a Redis without this script's users answers on 127.0.0.1:$REDIS_PORT (an older one?): stop it" \
            "(redis-cli -p $REDIS_PORT shutdown) and start again"
        log "Redis already answering on 127.0.0.1:$REDIS_PORT"; return 0
    fi
    umask 077  # its data is people's conversations: the owner's only
    mkdir -p "$RUN" && chmod 700 "$RUN"
    make_secret
    local t0; t0=$(date +%s%N)
    redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --protected-mode yes --daemonize yes \
        --dir "$RUN" --pidfile "$RUN/redis.pid" --logfile "$RUN/redis.log" \
        --appendonly yes --appendfsync everysec --save "" \
        --user default off nopass '~*' '&*' '+@all' \
        --user probe on nopass resetkeys resetchannels -@all +ping \
        --user admin on ">$(secret)" '~*' '&*' '+@all' >/dev/null
    wait_for 20 answers || { tail -n 20 "$RUN/redis.log" >&2; die "Redis did not answer on 127.0.0.1:$REDIS_PORT"; }
    log "Redis $(redis-server --version | grep -o 'v=[0-9.]*' | cut -c3-) up on 127.0.0.1:$REDIS_PORT in $(( ($(date +%s%N) - t0) / 1000000 )) ms"
}

stop() {
    if answers; then
        admin shutdown nosave >/dev/null 2>&1 || redis-cli -h 127.0.0.1 -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true
        wait_for 10 bash -c "! redis-cli --user probe --pass probe -h 127.0.0.1 -p $REDIS_PORT ping" || true
        log "Redis stopped"
    fi
}

case "${1:-start}" in
    install) install ;;
    start) start ;;
    stop) stop ;;
    status) answers ;;
    reset) stop; rm -rf "$RUN" ;;
    url) [[ -n "$(secret)" ]] || die "no Redis started here yet (scripts/redis.sh start)"
        echo "redis://admin:$(secret)@127.0.0.1:$REDIS_PORT/0" ;;
    *) die "usage: $0 install|start|stop|status|reset|url" ;;
esac
