#!/usr/bin/env bash
# The real Apache Kafka broker (KRaft, single node, loopback), assembled from Maven Central; one node of a cluster
# when KAFKA_VOTERS is set (scripts/kafka-cluster.sh starts three).
#   scripts/kafka.sh install   resolve the jars with Maven into the cache (idempotent)
#   scripts/kafka.sh start     install, format storage once, start in the background, wait until it answers
#   scripts/kafka.sh stop      stop the broker started by this script (its data is kept)
#   scripts/kafka.sh kill      kill -9 it (a crash; its data is kept)
#   scripts/kafka.sh status    exit 0 when the broker answers
#   scripts/kafka.sh reset     stop and delete its data
#   scripts/kafka.sh password  print the SASL operator's password (KAFKA_SASL=1): user admin, SCRAM-SHA-512
# With KAFKA_SASL=1, as the deployments run it: clients log in with SASL/SCRAM-SHA-512 and the broker authorizes
# every request by ACL (StandardAuthorizer, nothing allowed without one); `admin` (a super user, its password made
# once per data folder, 0600) exists from the format on; `turnstream kafka-users apply` makes the services' users.
# A formatted broker keeps the mode it was formatted in. `turnstream run` starts its broker so.
# Settings: KAFKA_PORT (9092), KAFKA_CONTROLLER_PORT (9093), KAFKA_HEAP (512m), KAFKA_SASL (0), TURNSTREAM_CACHE; for a cluster node
# KAFKA_NODE_ID, KAFKA_VOTERS (the controller quorum, id@host:port,...), KAFKA_CLUSTER_ID and KAFKA_SECRETS (the
# passwords' file) the same on each.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

POM="$REPO_ROOT/scripts/kafka/pom.xml"
KAFKA_VERSION="$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$POM")"
KAFKA_PORT="${KAFKA_PORT:-9092}"
KAFKA_CONTROLLER_PORT="${KAFKA_CONTROLLER_PORT:-9093}"
KAFKA_NODE_ID="${KAFKA_NODE_ID:-1}"
KAFKA_VOTERS="${KAFKA_VOTERS:-}"
pom_key="$(sha256sum "$POM" | cut -c1-12)"
LIBS="$TURNSTREAM_CACHE/kafka/$KAFKA_VERSION-$pom_key/libs"
RUN="$TURNSTREAM_CACHE/kafka/run-$KAFKA_PORT"
DATA="$RUN/data"
PIDFILE="$RUN/kafka.pid"
LOGFILE="$RUN/kafka.log"

answers() { (exec 3<>"/dev/tcp/127.0.0.1/$KAFKA_PORT") 2>/dev/null && grep -q "Kafka Server started" "$LOGFILE" 2>/dev/null; }
running() { [[ -f "$PIDFILE" ]] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }
SECRETS="${KAFKA_SECRETS:-$RUN/secrets}"  # a cluster's nodes share one: they log in to each other
KAFKA_SASL="${KAFKA_SASL:-0}"
if [[ -f "$DATA/meta.properties" ]]; then  # a broker keeps the mode it was formatted in (reset to change it)
    if [[ -f "$SECRETS" ]]; then KAFKA_SASL=1; else KAFKA_SASL=0; fi
fi
secret() { grep "^$1=" "$SECRETS" 2>/dev/null | cut -d= -f2; }
make_secrets() {  # URL-safe: SCRAM's format arguments are parsed as [key=value,...]
    [[ -f "$SECRETS" ]] && return 0
    mkdir -p "$(dirname "$SECRETS")"
    local who; for who in admin controller; do
        printf '%s=%s\n' "$who" "$(head -c 18 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=')"
    done >"$SECRETS"
    chmod 600 "$SECRETS"
}

install() {
    [[ -f "$LIBS/.complete" ]] && return 0
    command -v java >/dev/null || die "java not found: install Java 17 (apt-get install openjdk-17-jre-headless)"
    command -v mvn >/dev/null || die "mvn not found: install Maven (apt-get install maven)"
    log "assembling Apache Kafka $KAFKA_VERSION from Maven Central into $LIBS"
    rm -rf "$LIBS"; mkdir -p "$LIBS"
    mvn -q -B -ntp -Dstyle.color=never -f "$POM" dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$LIBS" \
        || die "Maven could not resolve org.apache.kafka:kafka_2.13:$KAFKA_VERSION"
    touch "$LIBS/.complete"
}

java_cmd() {
    java -Xms"${KAFKA_HEAP:-512m}" -Xmx"${KAFKA_HEAP:-512m}" -XX:+UseG1GC -Djava.awt.headless=true \
        -Dlog4j2.configurationFile="$REPO_ROOT/scripts/kafka/log4j2.properties" -cp "$LIBS/*" "$@"
}

listener_config() {
    if [[ "$KAFKA_SASL" != 1 ]]; then
        cat <<CONF
listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT,CONTROLLER://127.0.0.1:$KAFKA_CONTROLLER_PORT
advertised.listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
CONF
        return
    fi
    # Clients and brokers on CLIENT with SCRAM (users live in the metadata log); the controllers with PLAIN, whose
    # one user is in this file: a quorum votes before it has read any SCRAM user (KAFKA-15513).
    cat <<CONF
listeners=CLIENT://127.0.0.1:$KAFKA_PORT,CONTROLLER://127.0.0.1:$KAFKA_CONTROLLER_PORT
advertised.listeners=CLIENT://127.0.0.1:$KAFKA_PORT
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:SASL_PLAINTEXT,CLIENT:SASL_PLAINTEXT
inter.broker.listener.name=CLIENT
sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512
sasl.mechanism.controller.protocol=PLAIN
listener.name.client.sasl.enabled.mechanisms=SCRAM-SHA-512
listener.name.controller.sasl.enabled.mechanisms=PLAIN
listener.name.client.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="$(secret admin)";
listener.name.controller.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required username="controller" password="$(secret controller)" user_controller="$(secret controller)";
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
super.users=User:admin;User:controller
allow.everyone.if.no.acl.found=false
CONF
}

write_config() {
    umask 077  # its data is people's conversations: the owner's only
    mkdir -p "$RUN" && chmod 700 "$RUN"
    [[ "$KAFKA_SASL" == 1 ]] && make_secrets
    # A cluster keeps its internal topics (consumer offsets, transactions) in three copies, two needed to write.
    local quorum="controller.quorum.bootstrap.servers=127.0.0.1:$KAFKA_CONTROLLER_PORT" copies=1 insync=1
    if [[ -n "$KAFKA_VOTERS" ]]; then quorum="controller.quorum.voters=$KAFKA_VOTERS"; copies=3; insync=2; fi
    cat > "$RUN/server.properties" <<CONF
process.roles=broker,controller
node.id=$KAFKA_NODE_ID
$quorum
$(listener_config)
log.dirs=$DATA
num.partitions=3
offsets.topic.replication.factor=$copies
offsets.topic.num.partitions=6
transaction.state.log.replication.factor=$copies
transaction.state.log.min.isr=$insync
transaction.state.log.num.partitions=6
share.coordinator.state.topic.replication.factor=$copies
share.coordinator.state.topic.min.isr=$insync
group.initial.rebalance.delay.ms=0
group.consumer.heartbeat.interval.ms=1000
group.consumer.min.heartbeat.interval.ms=500
auto.create.topics.enable=false
delete.topic.enable=true
CONF
}

start() {
    install
    if running && answers; then log "Kafka $KAFKA_VERSION already running on 127.0.0.1:$KAFKA_PORT"; return 0; fi
    running && stop
    write_config
    if [[ ! -f "$DATA/meta.properties" ]]; then
        log "formatting KRaft storage in $DATA"
        local users=()  # the operator exists from the first record on: it makes every other user
        [[ "$KAFKA_SASL" == 1 ]] && users=(--add-scram "SCRAM-SHA-512=[name=admin,password=$(secret admin)]")
        if [[ -n "$KAFKA_VOTERS" ]]; then  # static voters: every node formatted with the cluster's one id
            java_cmd kafka.tools.StorageTool format -t "${KAFKA_CLUSTER_ID:?a cluster node needs KAFKA_CLUSTER_ID}" \
                -c "$RUN/server.properties" "${users[@]}" >/dev/null
        else
            java_cmd kafka.tools.StorageTool format --standalone -t "$(java_cmd kafka.tools.StorageTool random-uuid)" \
                -c "$RUN/server.properties" "${users[@]}" >/dev/null
        fi
    fi
    local t0; t0=$(date +%s%N)
    : > "$LOGFILE"
    setsid nohup bash -c "exec java -Xms${KAFKA_HEAP:-512m} -Xmx${KAFKA_HEAP:-512m} -XX:+UseG1GC \
        -Djava.awt.headless=true -Dlog4j2.configurationFile='$REPO_ROOT/scripts/kafka/log4j2.properties' \
        -cp '$LIBS/*' kafka.Kafka '$RUN/server.properties'" >>"$LOGFILE" 2>&1 < /dev/null &
    echo $! > "$PIDFILE"
    if ! wait_for 90 answers; then
        tail -n 40 "$LOGFILE" >&2
        die "Kafka did not answer on 127.0.0.1:$KAFKA_PORT within 90 s (log: $LOGFILE)"
    fi
    log "Kafka $KAFKA_VERSION up on 127.0.0.1:$KAFKA_PORT in $(( ($(date +%s%N) - t0) / 1000000 )) ms"
}

stop() {
    if running; then
        local pid; pid="$(cat "$PIDFILE")"
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -9 "$pid" 2>/dev/null || true
        log "Kafka stopped"
    fi
    rm -f "$PIDFILE"
}

case "${1:-start}" in
    install) install ;;
    start) start ;;
    stop) stop ;;
    kill) running || die "no Kafka of this script runs on 127.0.0.1:$KAFKA_PORT"
          kill -9 "$(cat "$PIDFILE")"; rm -f "$PIDFILE"; log "Kafka on 127.0.0.1:$KAFKA_PORT killed (kill -9)" ;;
    status) running && answers ;;
    reset) stop; rm -rf "$RUN" ;;  # a cluster's shared KAFKA_SECRETS is the cluster script's
    version) echo "$KAFKA_VERSION" ;;
    secrets) if [[ "$KAFKA_SASL" == 1 ]]; then make_secrets; fi ;;  # a cluster's, before its nodes start
    password) [[ -n "$(secret admin)" ]] || die "no SASL broker started here yet (KAFKA_SASL=1 scripts/kafka.sh start)"
              secret admin ;;
    *) die "usage: $0 install|start|stop|kill|status|reset|version|password|secrets" ;;
esac
