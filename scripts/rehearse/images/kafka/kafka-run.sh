#!/usr/bin/env bash
# apache/kafka's entrypoint, as far as compose.yaml uses it: KAFKA_FOO_BAR=v -> foo.bar=v (upstream's rule: "__"
# -> "_", "___" -> "-"), format KAFKA_LOG_DIRS once (kept on the volume) for cluster CLUSTER_ID (upstream's default
# when unset, so the brokers of compose.ha.yaml agree), run the broker in the foreground.
set -euo pipefail
conf=/opt/kafka/config/server.properties
: > "$conf"
while IFS='=' read -r name value; do
    case "$name" in KAFKA_HEAP_OPTS|KAFKA_OPTS|KAFKA_CLUSTER_ID) continue ;; esac
    key="${name#KAFKA_}"; key="${key,,}"; key="${key//___/-}"; key="${key//__/@}"; key="${key//_/.}"; key="${key//@/_}"
    printf '%s=%s\n' "$key" "$value" >> "$conf"
done < <(env | grep '^KAFKA_' | sort)
logs="${KAFKA_LOG_DIRS:-/var/lib/kafka/data}"
java_cmd() { exec_or_run=("$@"); java ${KAFKA_HEAP_OPTS} -XX:+UseG1GC -Djava.awt.headless=true \
    -Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties -cp '/opt/kafka/libs/*' "${exec_or_run[@]}"; }
if [[ ! -f "$logs/meta.properties" ]]; then
    cluster="${CLUSTER_ID:-5L6g3nShT-eMCtK--X86sw}"
    java_cmd kafka.tools.StorageTool format --standalone -t "$cluster" -c "$conf" \
        || java_cmd kafka.tools.StorageTool format -t "$cluster" -c "$conf"
fi
exec java ${KAFKA_HEAP_OPTS} -XX:+UseG1GC -Djava.awt.headless=true \
    -Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties -cp '/opt/kafka/libs/*' kafka.Kafka "$conf"
