#!/usr/bin/env bash
# A Redis that fails over, on loopback: a master, a replica and three Sentinels (quorum 2) watching them as the
# group "turnstream" (Debian's redis-server; tests/test_ha.py, docs/security.md).
#   scripts/redis-sentinel.sh start          start the five processes, wait until the Sentinels know the master
#   scripts/redis-sentinel.sh stop|reset     stop them (reset: and delete their data)
#   scripts/redis-sentinel.sh kill-master    kill -9 whichever server is the master now (the Sentinels promote the other)
#   scripts/redis-sentinel.sh restart-old    start the server killed last again (it rejoins as a replica)
#   scripts/redis-sentinel.sh master         print the master's host:port, as the Sentinels say
#   scripts/redis-sentinel.sh url            print the redis+sentinel:// URL for redis.url
# As compose.ha.yaml and the chart run it: the users of runtime/security/redis_users.py, rendered by `turnstream
# redis-users` into the servers' ACL file and the Sentinels' user lines (the default user off, `probe` for PING; a user per
# service; the replica's link, the Sentinels' and the operator's, admin; on the Sentinels a client user that may only
# ask where the master is). Passwords are made once per data folder (secrets, 0600); `url` logs in as admin.
# Settings: REDIS_SENTINEL_PORT (16479, below the ephemeral range): the servers on it and the port after, the Sentinels from it + 100.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

BASE="${REDIS_SENTINEL_PORT:-16479}"
SERVERS=("$BASE" "$(( BASE + 1 ))")
SENTINELS=("$(( BASE + 100 ))" "$(( BASE + 101 ))" "$(( BASE + 102 ))")
RUN="$TURNSTREAM_CACHE/redis/sentinel-$BASE"
GROUP=turnstream

replica_up() { cli -p "$1" info replication 2>/dev/null | grep -q '^master_link_status:up'; }
synced() {  # every server that is a replica has its link to the master up
    local port; for port in "${SERVERS[@]}"; do
        cli -p "$port" info replication 2>/dev/null | grep -q '^role:master' && continue
        cli -p "$port" info replication 2>/dev/null | grep -q '^master_link_status:up' || return 1
    done
}
PYTHON="${PYTHON:-$REPO_ROOT/.venv/bin/python}"
secret() { grep "^$1=" "$RUN/secrets" | cut -d= -f2; }
make_secrets() {  # a password per user, and the files Redis and the Sentinels read them from (hashed)
    if [[ ! -f "$RUN/secrets" ]]; then
        local name; for name in $(cd "$REPO_ROOT" && "$PYTHON" -c 'from runtime.security.redis_users import NAMES; print(*NAMES)'); do
            printf '%s=%s\n' "$name" "$(head -c 18 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=')"
        done >"$RUN/secrets"
        chmod 600 "$RUN/secrets"
    fi
    local env=() line name; while read -r line; do
        name="${line%%=*}"; env+=("REDIS_PASSWORD_${name^^}=${line#*=}")
    done <"$RUN/secrets"
    (cd "$REPO_ROOT" && env "${env[@]}" "$PYTHON" -m services.cli redis-users --out "$RUN/users.acl" \
        --sentinel-out "$RUN/sentinel-users.conf") 2>/dev/null || die "turnstream redis-users failed"
}
cli() { redis-cli --no-auth-warning --user admin --pass "$(secret admin)" -h 127.0.0.1 "$@"; }  # the operator
answers() { [[ "$(cli -p "$1" ping 2>/dev/null)" == "PONG" ]]; }
master() { cli -p "${SENTINELS[0]}" sentinel get-master-addr-by-name "$GROUP" 2>/dev/null | paste -sd: ; }
named() { [[ -n "$(master)" ]]; }

server() {  # PORT [replicaof PORT]
    local port="$1" dir="$RUN/server-$1"; mkdir -p "$dir" && chmod 700 "$dir"
    local args=(--bind 127.0.0.1 --port "$port" --protected-mode yes --daemonize yes --dir "$dir"
        --pidfile "$dir/redis.pid" --logfile "$dir/redis.log" --appendonly yes --appendfsync everysec --save ""
        --aclfile "$RUN/users.acl" --masteruser replica --masterauth "$(secret replica)")
    [[ $# -gt 1 ]] && args+=(--replicaof 127.0.0.1 "$3")
    redis-server "${args[@]}" >/dev/null
    wait_for 20 answers "$port" || die "Redis did not answer on 127.0.0.1:$port"
}

sentinel() {  # PORT: its config is rewritten by Sentinel itself, so it is written only once
    local port="$1" dir="$RUN/sentinel-$1"; mkdir -p "$dir" && chmod 700 "$dir"
    [[ -f "$dir/sentinel.conf" ]] || cat > "$dir/sentinel.conf" <<CONF
bind 127.0.0.1
port $port
dir $dir
$(cat "$RUN/sentinel-users.conf")
sentinel sentinel-user admin
sentinel sentinel-pass $(secret admin)
sentinel monitor $GROUP 127.0.0.1 ${SERVERS[0]} 2
sentinel auth-user $GROUP sentinel
sentinel auth-pass $GROUP $(secret sentinel)
sentinel down-after-milliseconds $GROUP 1000
sentinel failover-timeout $GROUP 5000
sentinel parallel-syncs $GROUP 1
CONF
    redis-server "$dir/sentinel.conf" --sentinel --daemonize yes --pidfile "$dir/sentinel.pid" \
        --logfile "$dir/sentinel.log" >/dev/null
    wait_for 20 answers "$port" || die "Sentinel did not answer on 127.0.0.1:$port"
}

start() {
    bash "$REPO_ROOT/scripts/redis.sh" install
    umask 077
    mkdir -p "$RUN"
    make_secrets
    answers "${SERVERS[0]}" || server "${SERVERS[0]}"
    answers "${SERVERS[1]}" || server "${SERVERS[1]}" replicaof "${SERVERS[0]}"
    local port; for port in "${SENTINELS[@]}"; do answers "$port" || sentinel "$port"; done
    wait_for 30 synced || die "the replica did not finish its first copy of the master"
    wait_for 30 named || die "the Sentinels name no master"
    log "Redis with Sentinel up: master $(master), Sentinels on ${SENTINELS[*]}"
}

stop() {
    local port; for port in "${SENTINELS[@]}" "${SERVERS[@]}"; do
        answers "$port" && cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
    done
    log "Redis with Sentinel stopped"
}

kill_master() {
    local port; port="$(master | cut -d: -f2)"
    [[ -n "$port" ]] || die "no master to kill"
    kill -9 "$(cat "$RUN/server-$port/redis.pid")"
    echo "$port" > "$RUN/killed"
    log "Redis master on 127.0.0.1:$port killed (kill -9)"
}

restart_old() {  # it comes back as the master it was; the Sentinels turn it into a replica of the new one
    local port; port="$(cat "$RUN/killed")"
    server "$port"
    # It starts as the master it was; the Sentinels turn it into a replica of the new one.
    wait_for 60 replica_up "$port" || die "the restarted server did not become a replica in step with the master"
    log "Redis on 127.0.0.1:$port started again"
}

url() {
    local out="" p; for p in "${SENTINELS[@]}"; do out+="${out:+,}127.0.0.1:$p"; done
    echo "redis+sentinel://admin:$(secret admin)@$out/$GROUP/0?sentinel_username=client&sentinel_password=$(secret client)"
}

case "${1:-start}" in
    start) start ;;
    stop) stop ;;
    reset) stop; rm -rf "$RUN" ;;
    kill-master) kill_master ;;
    restart-old) restart_old ;;
    master) master ;;
    url) url ;;
    *) die "usage: $0 start|stop|reset|kill-master|restart-old|master|url" ;;
esac
