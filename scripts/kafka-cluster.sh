#!/usr/bin/env bash
# Three Apache Kafka nodes (KRaft; each a broker and a controller of one quorum) on loopback: the replicated
# cluster turnstream's topics get three copies on (tests/test_ha.py, docs/scaling.md).
#   scripts/kafka-cluster.sh start          start the three nodes (one id, formatted once), wait until each answers
#   scripts/kafka-cluster.sh stop|reset     stop them (reset: and delete their data)
#   scripts/kafka-cluster.sh kill N         kill -9 node N (1-3): a broker crash
#   scripts/kafka-cluster.sh start-node N   start node N again
#   scripts/kafka-cluster.sh bootstrap      print the bootstrap servers
#   scripts/kafka-cluster.sh password       print the SASL operator's password (KAFKA_SASL=1, as for scripts/kafka.sh)
# Settings: KAFKA_CLUSTER_PORT (19192, below the ephemeral range): node N's broker listens on KAFKA_CLUSTER_PORT + 2(N-1), its controller on
# the port after; KAFKA_HEAP and KAFKA_SASL (SCRAM logins and ACLs, the nodes sharing one passwords' file) as for
# scripts/kafka.sh.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

BASE="${KAFKA_CLUSTER_PORT:-19192}"
NODES=(1 2 3)
broker_port() { echo $(( BASE + 2 * ($1 - 1) )); }
voters() { local out="" n; for n in "${NODES[@]}"; do out+="${out:+,}$n@127.0.0.1:$(( $(broker_port "$n") + 1 ))"; done; echo "$out"; }
ID_FILE="$TURNSTREAM_CACHE/kafka/cluster-$BASE.id"
export KAFKA_SECRETS="$TURNSTREAM_CACHE/kafka/cluster-$BASE.secrets"

node() {  # node N ACTION: scripts/kafka.sh for that node
    local n="$1"; shift
    KAFKA_PORT="$(broker_port "$n")" KAFKA_CONTROLLER_PORT="$(( $(broker_port "$n") + 1 ))" KAFKA_NODE_ID="$n" \
        KAFKA_VOTERS="$(voters)" KAFKA_CLUSTER_ID="$(cluster_id)" bash "$REPO_ROOT/scripts/kafka.sh" "$@"
}

cluster_id() {
    if [[ ! -f "$ID_FILE" ]]; then
        mkdir -p "$(dirname "$ID_FILE")"
        # A KRaft cluster id: 16 random bytes, URL-safe base64 without padding.
        head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n' > "$ID_FILE"
    fi
    cat "$ID_FILE"
}

start() {
    bash "$REPO_ROOT/scripts/kafka.sh" install
    cluster_id >/dev/null
    node 1 secrets  # made once, before the nodes start side by side
    # Together: a node answers only once a majority of the controllers has elected a leader.
    local pids=() n failed=0
    for n in "${NODES[@]}"; do node "$n" start & pids+=($!); done
    for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
    (( failed == 0 )) || die "a Kafka node did not start"
    log "Kafka cluster up: $(bootstrap)"
}

bootstrap() { local out="" n; for n in "${NODES[@]}"; do out+="${out:+,}127.0.0.1:$(broker_port "$n")"; done; echo "$out"; }

case "${1:-start}" in
    start) start ;;
    stop) for n in "${NODES[@]}"; do node "$n" stop; done ;;
    reset) for n in "${NODES[@]}"; do node "$n" reset; done; rm -f "$ID_FILE" "$KAFKA_SECRETS" ;;
    kill) node "${2:?which node (1-3)}" kill ;;
    start-node) node "${2:?which node (1-3)}" start ;;
    bootstrap) bootstrap ;;
    password) node 1 password ;;
    *) die "usage: $0 start|stop|reset|kill N|start-node N|bootstrap|password" ;;
esac
