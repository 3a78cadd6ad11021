#!/usr/bin/env bash
# `make rehearse-k8s`: the Helm chart (deploy/helm/turnstream) installed on a real single-node Kubernetes built on
# this machine, and driven from outside the pods as a user would drive it (docs/kubernetes.md).
#
#   1. Kubernetes v1.37.2, etcd, helm and CoreDNS built from the Go module proxy (scripts/k8s/build.sh: cached;
#      ~20 minutes cold) and started in a network namespace of its own (scripts/k8s/cluster.sh);
#   2. the images compose's rehearsal builds (stand-ins for Kafka, Redis and SGLang, turnstream's from the real
#      Dockerfile) imported into the cluster's containerd;
#   3. the chart linted, rendered and validated against the cluster's own API for every values file;
#   4. installed with values/cpu-rehearsal.yaml (SmolLM2 on two CPU policy replicas and a judge/teacher server,
#      three Kafka brokers, Redis with Sentinel, two judge replicas, the trainer as two pods under torchrun over
#      gloo) and the gate on; then, through the proxy's Service: sessions (OpenAI SDK), the Responses and Messages
#      APIs, turns recorded, paired, judged, taught, sampled, trained, a version decided by the gate and served on
#      both replicas, sessions spread over both replicas, topics with 3 copies;
#   5. faults in the middle of traffic: a policy pod, a Kafka broker pod and a trainer pod deleted: every turn
#      answered and recorded once, training goes on, no sample trained twice;
#   6. per-user keys: one added with scripts/k8s/keys.sh is served by every proxy (no restart), kept across
#      `helm upgrade` to a new configuration while sessions run (no turn lost), revoked and then refused;
#   7. everything stopped and removed, the host's settings as before (also on failure).
#
# It prints PASS/FAIL per check and the time, and exits non-zero on any failure. REHEARSE_KEEP=1 leaves the
# cluster running (bash scripts/k8s/cluster.sh stop removes it).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"
started=$(date +%s)
layout=k8s
RELEASE=ts
FN=ts-turnstream
CHART=deploy/helm/turnstream

source scripts/rehearse/checks.sh
k() { bash scripts/k8s/cluster.sh in kubectl "$@"; }
inside() { bash scripts/k8s/cluster.sh in "$@"; }  # a command in the cluster's network namespace
docker_was_up=""  # a Docker daemon answered before: not ours to stop
if (eval "$(bash scripts/rehearse/engine.sh env)"; docker info >/dev/null 2>&1); then docker_was_up=1; fi
cleanup() {
    local rc=$?
    if [[ -z "${REHEARSE_KEEP:-}" ]]; then
        bash scripts/k8s/cluster.sh stop >&2 || true
        [[ -n "$docker_was_up" ]] || bash scripts/rehearse/engine.sh stop >&2 || true
    fi
    return $rc
}
trap cleanup EXIT

build_started=$(date +%s)
bash scripts/k8s/build.sh >/dev/null
log "Kubernetes binaries ready in $(( $(date +%s) - build_started )) s (scripts/k8s/build.sh)"

bash scripts/rehearse/engine.sh start
eval "$(bash scripts/rehearse/engine.sh env)"
# What an interrupted `make rehearse` left: its containers restart with the daemon (restart: unless-stopped) and
# take the cluster's memory and cores (a run beside nine of them lost an engine to the OOM killer).
docker ps -aq --filter name=turnstream-rehearse- | xargs -r docker rm -f >/dev/null
bash scripts/rehearse/images.sh base kafka redis sglang
TURNSTREAM_IMAGE="turnstream-rehearse/turnstream:latest"
docker build -q --target runtime --build-arg BASE_IMAGE=turnstream-rehearse/debian-base:bookworm \
    -t "$TURNSTREAM_IMAGE" . >/dev/null
bash scripts/setup-venv.sh
models="$TURNSTREAM_CACHE/rehearse/models"
if [[ ! -f "$models/smollm2/config.json" ]]; then
    rm -rf "$models"; mkdir -p "$models"
    cp -r "$(.venv/bin/turnstream models fetch smollm2 | tail -1)" "$models/smollm2"
fi
chmod -R a+rX "$models"

bash scripts/k8s/cluster.sh stop >/dev/null 2>&1 || true  # what an interrupted run left
cluster_started=$(date +%s)
bash scripts/k8s/cluster.sh start
log "cluster up in $(( $(date +%s) - cluster_started )) s"
bash scripts/k8s/cluster.sh import "$TURNSTREAM_IMAGE" turnstream-rehearse/kafka:4.4.0 turnstream-rehearse/redis:7 \
    turnstream-rehearse/sglang:v0.5.23-cpu

checks bash scripts/k8s/check-chart.sh --server

# Pod Security: the release's namespace admits only pods that pass Kubernetes' `restricted` profile (the chart's
# every pod does: scripts/k8s/pod_security.py), and the models come from a claim (a hostPath volume is refused).
k label namespace default --overwrite pod-security.kubernetes.io/enforce=restricted \
    pod-security.kubernetes.io/enforce-version=latest >/dev/null
k apply -f - >/dev/null <<YAML
apiVersion: v1
kind: PersistentVolume
metadata: {name: rehearsal-models}
spec:
  capacity: {storage: 5Gi}
  accessModes: [ReadOnlyMany]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: ""
  hostPath: {path: $models, type: Directory}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: rehearsal-models, namespace: default}
spec:
  accessModes: [ReadOnlyMany]
  storageClassName: ""
  volumeName: rehearsal-models
  resources: {requests: {storage: 5Gi}}
YAML
refused_as_root() {  # a pod as root is refused at admission, naming the profile and the rule
    local said
    said="$(k run psa-root --image="$TURNSTREAM_IMAGE" --image-pull-policy=Never --restart=Never \
        --overrides='{"spec": {"securityContext": {"runAsUser": 0}}}' --command -- true 2>&1)" && return 1
    grep -q 'violates PodSecurity "restricted' <<<"$said" && grep -q 'runAsUser=0' <<<"$said"
}
checks verdict "Pod Security restricted refuses a pod that runs as root" refused_as_root

cpu_flags="$(.venv/bin/python -c 'import json; from services.engine.launch import CPU_FLAGS; print(json.dumps([*CPU_FLAGS, "--max-total-tokens", "16384"]))')"
secret() { head -c 18 /dev/urandom | base64 | tr '+/' '-_'; }
export PROXY_API_KEY CONSOLE_TOKEN
PROXY_API_KEY="$(secret)"
CONSOLE_TOKEN="$(secret)"
# The settings compose's rehearsal uses (scripts/rehearse.sh says why): small batches, a checkpoint every step, the
# rules judge (SmolLM2 cannot follow the judge's prompt), judge answers within SmolLM2's context, the gate on with a
# margin every evaluated candidate passes.
install_args=(
    -f "$CHART/values/cpu-rehearsal.yaml"
    --set models.existingClaim=rehearsal-models
    --set-json "policy.extraArgs=$cpu_flags" --set-json "teacherServer.extraArgs=$cpu_flags"
    --set "secrets.proxyApiKey=$PROXY_API_KEY" --set "secrets.consoleToken=$CONSOLE_TOKEN"
    --set gate.enabled=true --set gate.margin=1
    --set judge.backend=rules --set trainer.rolloutBatchSize=2 --set trainer.checkpointEverySteps=1
    --set-string env.PRM_MAX_NEW_TOKENS=512
)
log "helm install ($CHART, values/cpu-rehearsal.yaml)"
install_started=$(date +%s)
checks verdict "helm install" inside helm install "$RELEASE" "$CHART" "${install_args[@]}"
proxy_ip="$(k get svc "$FN-proxy" -o jsonpath='{.spec.clusterIP}')"
proxy="http://$proxy_ip:8000"
ready() { inside curl -fsS "$proxy/healthz"; }
all_ready() {  # every pod of the release running and ready (the topics job's completed)
    ! k get pods -l app.kubernetes.io/instance="$RELEASE" --no-headers \
        | awk '$3 != "Completed" { split($2, r, "/"); if (r[1] != r[2] || $3 != "Running") print }' | grep -q .
}
checks verdict "every pod ready" wait_for 1500 all_ready
checks verdict "the proxy answers through its Service ($proxy)" wait_for 300 ready
log "installed and ready in $(( $(date +%s) - install_started )) s"
[[ $failures -eq 0 ]] || { k get pods -o wide >&2; k describe pods | tail -80 >&2; }

kafka_password() { k get secret "$FN-kafka-users" -o jsonpath="{.data.$1}" | base64 -d; }
pipeline() {  # pipeline_check.py inside the proxy's pod (its settings: Kafka, Redis through the Sentinels, keys),
    # as Kafka's operator: it reads every topic
    k exec -i "$FN-proxy-0" -c proxy -- env TURNSTREAM_KAFKA_SASL_USERNAME=admin \
        TURNSTREAM_KAFKA_SASL_PASSWORD="$(kafka_password admin)" KAFKA_PASSWORD_JUDGE="$(kafka_password judge)" \
        python - "$@" <scripts/rehearse/pipeline_check.py
}
client() { inside .venv/bin/python scripts/rehearse/client.py "$@"; }
next_version() {
    pipeline counts 2>/dev/null | tail -1 | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["weights"] + 1)'
}
talk_while() {  # talk_while TAG COMMAND...: sessions through the proxy's Service, COMMAND run 8 s into them
    local out; out="$(mktemp)"
    client talk "$proxy/v1" --sessions 4 --turns 4 --tag "$1" >"$out" 2>&1 &
    local talker=$!
    shift; sleep 8; "$@" >&2
    wait "$talker" || true
    cat "$out"; rm -f "$out"
}
deleted_in_traffic() {  # TAG POD WHAT: POD deleted 8 s into sessions, the pipeline checked, its replacement ready
    local version; version="$(next_version)"
    log "[$layout] $3"
    checks talk_while "$1" k delete pod "$2" --wait=false
    checks pipeline flow "$version" --within 900
    checks pipeline lineage
    checks verdict "$2 replaced and ready" wait_for 900 all_ready
}

checks client talk "$proxy/v1" --sessions 8 --turns 2 --tag a  # 8 sessions: all on one of 2 replicas 1 time in 128
checks client apis "$proxy/v1"
checks pipeline flow 1 --within 900
checks pipeline gate 1 --within 600
checks client served "$proxy/v1" 1 --within 300
checks pipeline engine
checks pipeline replicas rehearse-a-
checks pipeline topics
checks pipeline lineage
console_ip="$(k get svc "$FN-console" -o jsonpath='{.spec.clusterIP}')"
# by a host name it serves (console.allowedHosts; an address it does not know gets 421)
checks verdict "the console answers through its Service" inside curl -fsS -H "Host: localhost" \
    "http://$console_ip:8080/healthz"
checks verdict "the console serves its token" inside curl -fsS -o /dev/null -H "Host: localhost" \
    -H "Authorization: Bearer $CONSOLE_TOKEN" "http://$console_ip:8080/api/sessions"

log "[$layout] per-user keys: scripts/k8s/keys.sh adds one to the chart's Secret; every proxy serves it"
export KUBECTL="bash scripts/k8s/cluster.sh in kubectl" RELEASE
user_key="$(bash scripts/k8s/keys.sh add rehearse-alice | tail -1)"
every_proxy_answers() {  # every_proxy_answers KEY STATUS: each proxy pod gives KEY that status on /v1/models
    local ip
    for ip in $(k get pods -l app.kubernetes.io/instance="$RELEASE",app.kubernetes.io/component=proxy \
        -o jsonpath='{.items[*].status.podIP}'); do
        [[ "$(inside curl -s -o /dev/null -w '%{http_code}' -H "Authorization: Bearer $1" "http://$ip:8000/v1/models")" == "$2" ]] \
            || return 1
    done
}
checks verdict "a key added by scripts/k8s/keys.sh is served by every proxy, none restarted" \
    wait_for 240 every_proxy_answers "$user_key" 200
checks verdict "the shared key still serves" every_proxy_answers "$PROXY_API_KEY" 200

log "[$layout] Redis as deployed: a user per service, the default user off, the Sentinels for client and admin"
redis_password() { k get secret "$FN-redis-users" -o jsonpath="{.data.$1}" | base64 -d; }
k_says() {  # k_says POD CONTAINER PATTERN REDIS-CLI-ARGS...: redis-cli there answers a line matching PATTERN
    local pod="$1" container="$2" pattern="$3"; shift 3
    k exec "$pod" -c "$container" -- redis-cli --no-auth-warning "$@" 2>&1 | grep -qE "$pattern"
}
judge=(--user judge --pass "$(redis_password judge)")
checks verdict "Redis refuses a client without a password (a sealing key: NOAUTH)" \
    k_says "$FN-redis-0" redis '^NOAUTH' get turnstream:dek:x
checks verdict "Redis refuses the judge's user the proxy's stored answers" \
    k_says "$FN-redis-0" redis '^NOPERM' "${judge[@]}" get turnstream:resp:x
checks verdict "Redis refuses the judge's user a FLUSHALL" k_says "$FN-redis-0" redis '^NOPERM' "${judge[@]}" flushall
checks verdict "the Sentinels refuse a client without a password" \
    k_says "$FN-redis-sentinel-0" sentinel 'NOAUTH' -p 26379 sentinel get-master-addr-by-name turnstream
checks verdict "the Sentinels refuse the services' client user a failover" \
    k_says "$FN-redis-sentinel-0" sentinel '^NOPERM' -p 26379 --user client --pass "$(redis_password client)" \
    sentinel failover turnstream

log "[$layout] Kafka as deployed: SCRAM logins, a user per service, ACLs"
checks pipeline kafka

log "[$layout] pods apart: the chart's NetworkPolicies, enforced by kube-router's firewall"
# connects POD CONTAINER HOST PORT: whether a TCP connection from that container reaches HOST:PORT within 5 s
connects() {
    k exec "$1" -c "$2" -- python -c "import socket,sys; socket.create_connection(('$3', $4), 5)" >/dev/null 2>&1
}
refused_from() { ! connects "$@"; }
restricted='{"spec": {"securityContext": {"runAsNonRoot": true, "runAsUser": 10001, "seccompProfile": {"type": "RuntimeDefault"}},
  "containers": [{"name": "np-outsider", "securityContext": {"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}}}]}}'
k run np-outsider --image="$TURNSTREAM_IMAGE" --image-pull-policy=Never --restart=Never --labels=app=outsider \
    --override-type=strategic --overrides="$restricted" --command -- sleep 3600 >/dev/null
k wait --for=condition=Ready pod/np-outsider --timeout=120s >/dev/null
redis_host="$FN-redis-0.$FN-redis" kafka_host="$FN-kafka-0.$FN-kafka" policy_host="$FN-policy-0.$FN-policy"
proxy_reaches_all() {
    connects "$FN-proxy-0" proxy "$redis_host" 6379 && connects "$FN-proxy-0" proxy "$kafka_host" 9092 \
        && connects "$FN-proxy-0" proxy "$policy_host" 30000
}
checks verdict "the proxy reaches Redis, Kafka and a policy server" proxy_reaches_all
checks verdict "a pod outside the release cannot reach Redis" refused_from np-outsider np-outsider "$redis_host" 6379
checks verdict "a pod outside the release cannot reach Kafka" refused_from np-outsider np-outsider "$kafka_host" 9092
checks verdict "a pod outside the release cannot reach a policy server" \
    refused_from np-outsider np-outsider "$policy_host" 30000
checks verdict "a pod outside the release cannot reach the trainer's rendezvous" \
    refused_from np-outsider np-outsider "$FN-trainer-0.$FN-trainer" 29500
checks verdict "a pod outside the release still reaches the proxy (the front door)" \
    connects np-outsider np-outsider "$FN-proxy" 8000
gate_pod="$(k get pods -l app.kubernetes.io/component=gate -o jsonpath='{.items[0].metadata.name}')"
checks verdict "the gate's pod, not an engine's client, cannot reach a policy server" \
    refused_from "$gate_pod" gate "$policy_host" 30000
checks verdict "the gate's pod cannot reach Kafka's controller port" refused_from "$gate_pod" gate "$kafka_host" 9093
k delete pod np-outsider --wait=false >/dev/null

deleted_in_traffic p "$FN-policy-1" "a policy pod deleted in the middle of traffic"
checks pipeline engine
deleted_in_traffic k "$FN-kafka-1" "a Kafka broker pod deleted in the middle of traffic"
deleted_in_traffic t "$FN-trainer-1" "a trainer pod deleted in the middle of traffic (the group restarts and resumes)"

log "[$layout] helm upgrade to a new configuration while sessions run"
version="$(next_version)"
checks talk_while u inside helm upgrade "$RELEASE" "$CHART" "${install_args[@]}" --set-string env.TURNSTREAM_PROXY_OVERLOAD_ABS=6
checks verdict "every pod ready after the upgrade" wait_for 1500 all_ready
checks verdict "the proxy runs the new configuration" test \
    "$(k get statefulset "$FN-proxy" -o jsonpath='{.spec.template.spec.containers[0].env[?(@.name=="TURNSTREAM_PROXY_OVERLOAD_ABS")].value}')" = 6
checks verdict "the per-user key survived the upgrade" every_proxy_answers "$user_key" 200
bash scripts/k8s/keys.sh revoke rehearse-alice
checks verdict "revoked, it is refused by every proxy" wait_for 240 every_proxy_answers "$user_key" 401
checks pipeline flow "$version" --within 900
checks pipeline lineage
[[ $failures -eq 0 ]] || { k get pods -o wide >&2; k logs "$FN-trainer-0" --tail 40 >&2 || true; }

printf '\n%s\n' "rehearse-k8s: ${#results[@]} checks, $failures failed, $(( $(date +%s) - started )) s"
for line in "${results[@]}"; do printf '  %s\n' "$line"; done
[[ $failures -eq 0 ]]
