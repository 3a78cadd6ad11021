#!/usr/bin/env bash
# The real Apache Kafka broker (KRaft, single node, loopback), assembled from Maven Central; one node of a cluster
# when KAFKA_VOTERS is set (scripts/kafka-cluster.sh starts three).
#   scripts/kafka.sh install   resolve the jars with Maven into the cache (idempotent)
#   scripts/kafka.sh start     install, format storage once, start in the background, wait until it answers
#   scripts/kafka.sh stop      stop the broker started by this script (its data is kept)
#   scripts/kafka.sh kill      kill -9 it (a crash; its data is kept)
#   scripts/kafka.sh status    exit 0 when the broker answers
#   scripts/kafka.sh reset     stop and delete its data
# Settings: KAFKA_PORT (9092), KAFKA_CONTROLLER_PORT (9093), KAFKA_HEAP (512m), TURNSTREAM_CACHE; for a cluster node
# KAFKA_NODE_ID, KAFKA_VOTERS (the controller quorum, id@host:port,...) and KAFKA_CLUSTER_ID (the same on each).
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

write_config() {
    umask 077  # its data is people's conversations: the owner's only
    mkdir -p "$RUN" && chmod 700 "$RUN"
    # A cluster keeps its internal topics (consumer offsets, transactions) in three copies, two needed to write.
    local quorum="controller.quorum.bootstrap.servers=127.0.0.1:$KAFKA_CONTROLLER_PORT" copies=1 insync=1
    if [[ -n "$KAFKA_VOTERS" ]]; then quorum="controller.quorum.voters=$KAFKA_VOTERS"; copies=3; insync=2; fi
    cat > "$RUN/server.properties" <<CONF
process.roles=broker,controller
node.id=$KAFKA_NODE_ID
$quorum
listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT,CONTROLLER://127.0.0.1:$KAFKA_CONTROLLER_PORT
advertised.listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
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
        if [[ -n "$KAFKA_VOTERS" ]]; then  # static voters: every node formatted with the cluster's one id
            java_cmd kafka.tools.StorageTool format -t "${KAFKA_CLUSTER_ID:?a cluster node needs KAFKA_CLUSTER_ID}" \
                -c "$RUN/server.properties" >/dev/null
        else
            java_cmd kafka.tools.StorageTool format --standalone -t "$(java_cmd kafka.tools.StorageTool random-uuid)" \
                -c "$RUN/server.properties" >/dev/null
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
    reset) stop; rm -rf "$RUN" ;;
    version) echo "$KAFKA_VERSION" ;;
    *) die "usage: $0 install|start|stop|kill|status|reset|version" ;;
esac
