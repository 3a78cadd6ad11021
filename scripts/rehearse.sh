#!/usr/bin/env bash
# `make rehearse`: the GPU-host deployment (`docker compose up`) rehearsed in real containers on a machine without a
# GPU or Docker Hub, driven from the host as a user would drive it.
#
#   1. a Docker engine (scripts/rehearse/engine.sh: started if none answers, Debian's docker.io installed when
#      missing, its own data root and socket under the cache) and the compose plugin (built once, cached);
#   2. local stand-ins for the images that cannot be pulled here (scripts/rehearse/images.sh: Debian base, Kafka
#      4.4.0 from the Maven jars, Redis and Prometheus from Debian, SGLang 0.5.23 from the locked CPU venv);
#      Grafana has none and stays out;
#   3. turnstream's image from the real Dockerfile (runtime target; only BASE_IMAGE differs);
#   4. per layout (two engines: compose.yaml; one GPU with LoRA: + compose.one-gpu.yaml; replicas: two policy
#      servers, three Kafka brokers and Redis with Sentinel, + compose.replicas.yaml + compose.ha.yaml), with
#      compose.cpu.yaml (and compose.cpu.replicas.yaml) over it (images, GPU reservations, trainer precision:
#      nothing else), SmolLM2 as the model and SGLang's CPU
#      flags in POLICY_SGLANG_ARGS/TEACHER_SGLANG_ARGS: up; the OpenAI SDK through the published proxy port (multi-
#      turn sessions, streamed and not, OpenClaw-RL's session headers), and the Responses and Messages APIs with
#      their vendors' SDKs; turns recorded, paired, judged, taught,
#      sampled, trained; the policy server loads the version from the shared volume (one-gpu: as a LoRA adapter
#      beside the base) once the gate promoted it (GATE_ENABLED, on unless REHEARSE_GATE=false) and a new turn
#      carries it; a per-user key added with the keys service is served and, revoked, refused without a restart;
#      the console and Prometheus answer, the console's logged login link opens it, every Prometheus
#      target is up; `down` and `up` again: the volumes keep the state, the trainer resumes, versions go on and no
#      sample is trained twice; `down -v`. The replicas layout also checks that sessions spread over both policy
#      servers and stay put, every topic has 3 copies, and kills in the middle of traffic a Kafka broker, the Redis
#      master and a policy server (each started again after): every turn answered and recorded once, training
#      goes on, no sample trained twice, the restarted policy server back on the served version and in rotation.
#
# It prints PASS/FAIL per check and the time, exits non-zero on any failure, and removes what it started
# (containers, networks, volumes), leaving the image cache. REHEARSE_LAYOUTS="two-engines one-gpu replicas"
# (default) picks layouts; REHEARSE_KEEP=1 leaves the last layout running.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"
started=$(date +%s)
LAYOUTS="${REHEARSE_LAYOUTS:-two-engines one-gpu replicas}"

source scripts/rehearse/checks.sh

bash scripts/rehearse/engine.sh start
eval "$(bash scripts/rehearse/engine.sh env)"
docker compose version >/dev/null || die "the compose plugin did not come up"

log "stand-in images (cached)"
bash scripts/rehearse/images.sh
base_image="turnstream-rehearse/debian-base:bookworm"
# compose.yaml's images by name (compose.cpu.yaml defaults to the same; services that extend others inherit these)
export KAFKA_IMAGE="turnstream-rehearse/kafka:4.4.0" REDIS_IMAGE="turnstream-rehearse/redis:7"
export SGLANG_IMAGE="turnstream-rehearse/sglang:v0.5.23-cpu" PROMETHEUS_IMAGE="turnstream-rehearse/prometheus:v3.5.0"
export TURNSTREAM_IMAGE="turnstream-rehearse/turnstream:latest"
log "turnstream's image from the real Dockerfile (runtime target, BASE_IMAGE=$base_image)"
build_started=$(date +%s)
docker build -q --target runtime --build-arg BASE_IMAGE="$base_image" -t "$TURNSTREAM_IMAGE" . >/dev/null
log "turnstream image built in $(( $(date +%s) - build_started )) s"

bash scripts/setup-venv.sh
models="$TURNSTREAM_CACHE/rehearse/models"
if [[ ! -f "$models/smollm2/config.json" ]]; then
    rm -rf "$models"; mkdir -p "$models"
    cp -r "$(.venv/bin/turnstream models fetch smollm2 | tail -1)" "$models/smollm2"
fi
chmod -R a+rX "$models"  # the services run as uid 10001 and read the model folder

cpu_flags="$(.venv/bin/python -c 'from services.engine.launch import CPU_FLAGS; print(" ".join(CPU_FLAGS))')"
export MODELS_DIR="$models" POLICY_MODEL=/models/smollm2
export PROXY_PORT="${REHEARSE_PROXY_PORT:-18000}" CONSOLE_PORT="${REHEARSE_CONSOLE_PORT:-18080}"
export PROMETHEUS_PORT="${REHEARSE_PROMETHEUS_PORT:-19090}"
# The secrets scripts/compose-secrets.sh would write to .env (Grafana is left out of the rehearsal; compose still
# needs its password to read the file), made fresh for each rehearsal.
export GRAFANA_ADMIN_PASSWORD="${GRAFANA_ADMIN_PASSWORD:-$(head -c 18 /dev/urandom | base64 | tr '+/' '-_')}"
export CONSOLE_TOKEN="${CONSOLE_TOKEN:-$(head -c 18 /dev/urandom | base64 | tr '+/' '-_')}"
export PROXY_API_KEY="${PROXY_API_KEY:-$(head -c 18 /dev/urandom | base64 | tr '+/' '-_')}"
export ENGINE_API_KEY="${ENGINE_API_KEY:-$(head -c 18 /dev/urandom | base64 | tr '+/' '-_')}"
export ENGINE_ADMIN_API_KEY="${ENGINE_ADMIN_API_KEY:-$(head -c 18 /dev/urandom | base64 | tr '+/' '-_')}"
# The rest (a password per Redis user) as users make them: scripts/compose-secrets.sh, into a file of this run's.
secrets_file="$(mktemp)"
COMPOSE_SECRETS_FILE="$secrets_file" bash scripts/compose-secrets.sh >/dev/null 2>&1
set -a; source "$secrets_file"; set +a
rm -f "$secrets_file"
export ROLLOUT_BATCH_SIZE=2 TRAINER_CHECKPOINT_EVERY_STEPS=1 TURNSTREAM_LOG_LEVEL=INFO
# SmolLM2's context is 8,192 tokens: a judge answer of combine's default 8,192 plus the prompt is refused by SGLang.
# And SmolLM2 cannot follow the judge's prompt (its votes parse as no verdict and no hint, so nothing would train):
# the rehearsal's judge is the rules backend, on the real judge service and topics (JUDGE_BACKEND, as a user sets it).
export PRM_MAX_NEW_TOKENS=512 JUDGE_BACKEND="${REHEARSE_JUDGE_BACKEND:-rules}"
# The gate is on (REHEARSE_GATE=false: off, every version served as published): each version is a candidate, held
# out evaluated (two engines: served, then checked; one GPU: as an adapter beside the promoted one) and decided. With
# a margin of 1 every evaluated candidate passes, so the rehearsal can require the promotion to reach users; what a
# failing candidate does is the gate's tests' and bench/guarded.py's business (docs/evaluation.md).
export GATE_ENABLED="${REHEARSE_GATE:-true}" GATE_MARGIN="${REHEARSE_GATE_MARGIN:-1}"
proxy="http://127.0.0.1:$PROXY_PORT"

compose() { docker compose "${files[@]}" "$@"; }
up_log="$(mktemp)"  # what `compose up` said: shown when it fails (the check's own output is not)
in_network() {  # an operator's check inside turnstream's image on the compose network (Kafka advertises kafka:9092)
    compose run --rm --no-deps -v "$REPO_ROOT/scripts/rehearse:/rehearse:ro" --entrypoint python \
        -e TURNSTREAM_KAFKA_SASL_USERNAME=admin -e TURNSTREAM_KAFKA_SASL_PASSWORD="$KAFKA_PASSWORD_ADMIN" \
        -e KAFKA_PASSWORD_JUDGE="$KAFKA_PASSWORD_JUDGE" proxy "$@"
}
up() {
    # every service but grafana (no stand-in); compose starts them in dependency order and waits on health
    local services
    services="$(compose config --services | grep -vx grafana | tr '\n' ' ')"
    # shellcheck disable=SC2086
    compose up -d $services >"$up_log" 2>&1
    wait_for 900 curl -fsS "$proxy/healthz"
}
targets_up() {
    curl -fsS "http://127.0.0.1:$PROMETHEUS_PORT/api/v1/targets" | .venv/bin/python -c '
import json, sys
targets = json.load(sys.stdin)["data"]["activeTargets"]
down = [t["scrapeUrl"] for t in targets if t["health"] != "up"]
print(len(targets), "targets;", "down:", down or "none")
sys.exit(1 if down or not targets else 0)'
}
cleanup() {
    local rc=$?
    if [[ ${#files[@]} -gt 0 && -z "${REHEARSE_KEEP:-}" ]]; then
        compose down -v --remove-orphans >/dev/null 2>&1 || true
    fi
    return $rc
}
files=()
trap cleanup EXIT

next_version() {  # one more than the versions published so far
    in_network /rehearse/pipeline_check.py counts 2>/dev/null | tail -1 \
        | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["weights"] + 1)'
}
talk_while() {  # talk_while TAG COMMAND...: sessions through the proxy, COMMAND run 8 s into them
    local out; out="$(mktemp)"
    .venv/bin/python scripts/rehearse/client.py talk "$proxy/v1" --sessions 4 --turns 4 --tag "$1" >"$out" 2>&1 &
    local talker=$!
    shift; sleep 8; "$@" >&2
    wait "$talker" || true
    cat "$out"; rm -f "$out"
}
healthy() { [[ "$(docker inspect -f '{{.State.Health.Status}}' "$(compose ps -q "$1")" 2>/dev/null)" == healthy ]]; }
killed_in_traffic() {  # TAG SERVICE WHAT: SERVICE killed 8 s into sessions, the pipeline checked, SERVICE started
    local version; version="$(next_version)"
    log "[$layout] $3"
    checks talk_while "$1" compose kill "$2"
    checks in_network /rehearse/pipeline_check.py flow "$version" --within 900
    checks in_network /rehearse/pipeline_check.py lineage
    compose start "$2" >&2
}
faults() {  # the replicas layout: sessions spread, topics replicated; a broker, the Redis master, a policy server die
    checks in_network /rehearse/pipeline_check.py replicas rehearse-a-
    checks in_network /rehearse/pipeline_check.py topics
    killed_in_traffic k kafka "a Kafka broker killed in the middle of traffic"
    checks verdict "the killed broker is back" wait_for 300 healthy kafka
    killed_in_traffic r redis "the Redis master killed in the middle of traffic (the Sentinels promote the replica)"
    log "[$layout] a policy server killed: new sessions go to the other; started again, it loads the served version"
    compose kill sglang-policy-2 >&2
    checks .venv/bin/python scripts/rehearse/client.py talk "$proxy/v1" --sessions 3 --turns 2 --tag p
    checks in_network /rehearse/pipeline_check.py replicas rehearse-p- sglang-policy
    compose start sglang-policy-2 >&2
    checks verdict "the killed policy server is back" wait_for 900 healthy sglang-policy-2
    checks in_network /rehearse/pipeline_check.py engine
    checks .venv/bin/python scripts/rehearse/client.py talk "$proxy/v1" --sessions 3 --turns 2 --tag q
    checks in_network /rehearse/pipeline_check.py replicas rehearse-q-
    checks in_network /rehearse/pipeline_check.py lineage
}

for layout in $LAYOUTS; do
    layout_started=$(date +%s)
    case "$layout" in
        two-engines) files=(-f compose.yaml -f compose.cpu.yaml); lora_flags="" ;;
        one-gpu) files=(-f compose.yaml -f compose.one-gpu.yaml -f compose.cpu.yaml)
            lora_flags="--lora-backend torch_native" ;;  # SGLang's one LoRA backend without GPU kernels
        replicas) files=(-f compose.yaml -f compose.replicas.yaml -f compose.ha.yaml -f compose.cpu.yaml
            -f compose.cpu.replicas.yaml); lora_flags="" ;;
        *) die "unknown layout $layout (two-engines, one-gpu, replicas)" ;;
    esac
    export COMPOSE_PROJECT_NAME="turnstream-rehearse-$layout"
    export POLICY_SGLANG_ARGS="$cpu_flags --max-total-tokens 16384 $lora_flags" TEACHER_SGLANG_ARGS="$cpu_flags --max-total-tokens 16384"
    compose down -v --remove-orphans >/dev/null 2>&1 || true
    log "[$layout] up (${files[*]})"
    before_up=$failures
    checks verdict "up: the proxy answers on $proxy" up
    if [[ $failures -gt $before_up ]]; then  # nothing to drive
        grep -v 'variable is not set' "$up_log" | tail -20; compose ps -a; compose logs --tail 60; break
    fi
    log "[$layout] Grafana has no stand-in here (no registry ships it): left out of the rehearsal"

    checks .venv/bin/python scripts/rehearse/client.py talk "$proxy/v1" --sessions 8 --turns 2 --tag a  # 8 sessions: all on one of 2 replicas 1 time in 128
    checks .venv/bin/python scripts/rehearse/client.py apis "$proxy/v1"
    checks in_network /rehearse/pipeline_check.py flow 1 --within 900
    checks in_network /rehearse/pipeline_check.py gate 1 --within 600
    checks .venv/bin/python scripts/rehearse/client.py served "$proxy/v1" 1 --within 300
    checks in_network /rehearse/pipeline_check.py engine
    checks verdict "the console answers" curl -fsS "http://127.0.0.1:$CONSOLE_PORT/healthz"
    checks verdict "the console refuses a request without its token" \
        test "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$CONSOLE_PORT/api/sessions")" = 401
    checks verdict "the console serves its token" \
        curl -fsS -o /dev/null -H "Authorization: Bearer $CONSOLE_TOKEN" "http://127.0.0.1:$CONSOLE_PORT/api/sessions"
    login_link="http://127.0.0.1:$CONSOLE_PORT/login?token=$CONSOLE_TOKEN"
    checks verdict "the console's login link opens it" curl -fsS -o /dev/null "$login_link"
    log_without_token() { ! compose logs console 2>/dev/null | grep -qF "$CONSOLE_TOKEN"; }
    checks verdict "the console's log holds no token" log_without_token
    # Per-user keys as docs/security.md says to deploy them: the keys service writes the proxy's keys volume.
    status_of() { curl -s -o /dev/null -w '%{http_code}' -H "Authorization: Bearer $1" "$proxy/v1/models"; }
    answers() { [[ "$(status_of "$1")" == "$2" ]]; }
    user_key="$(compose run --rm -T keys add rehearse-alice 2>/dev/null | tail -1)"
    checks verdict "a key made by 'docker compose run --rm keys add' is served" wait_for 30 answers "$user_key" 200
    listed() { compose run --rm -T keys list 2>/dev/null | grep -q '^rehearse-alice '; }
    checks verdict "'keys list' names its user" listed
    compose run --rm -T keys revoke rehearse-alice >/dev/null 2>&1 || true
    checks verdict "the key revoked is refused, the proxy not restarted" wait_for 30 answers "$user_key" 401
    checks verdict "the shared key still serves" answers "$PROXY_API_KEY" 200
    # Redis as deployed (docs/security.md): a user per service, the default user off, operators as admin.
    says() { local pattern="$1"; shift; compose exec -T redis redis-cli --no-auth-warning "$@" 2>&1 | grep -qE "$pattern"; }
    refused() { says '^NOPERM' "$@"; }
    checks verdict "Redis refuses a client without a password (a sealing key: NOAUTH)" says '^NOAUTH' get turnstream:dek:x
    checks verdict "Redis's probe user may PING and nothing else" refused --user probe --pass probe get turnstream:dek:x
    judge=(--user judge --pass "$REDIS_PASSWORD_JUDGE")
    checks verdict "Redis refuses the judge's user the proxy's stored answers" refused "${judge[@]}" get turnstream:resp:x
    checks verdict "Redis refuses the judge's user a FLUSHALL" refused "${judge[@]}" flushall
    operator() { compose exec -T redis redis-cli --no-auth-warning --user admin --pass "$REDIS_PASSWORD_ADMIN" dbsize \
        | grep -qE '^[0-9]+$'; }
    checks verdict "Redis serves its operator (admin)" operator
    # Kafka as deployed: SCRAM logins, a user per service, ACLs (runtime/security/kafka_users.py).
    checks in_network /rehearse/pipeline_check.py kafka
    reach() {  # whether the service's container can open a policy server's health check
        compose exec -T "$1" python -c \
            "import urllib.request; urllib.request.urlopen('http://${2:-sglang-policy}:30000/health', timeout=5)" \
            >/dev/null 2>&1
    }
    checks verdict "the proxy reaches the policy server on the engines network" reach proxy
    [[ $layout == replicas ]] && checks verdict "the proxy reaches the second policy server" reach proxy sglang-policy-2
    unreachable() { ! reach "$1"; }
    checks verdict "the console, off that network, cannot" unreachable console
    sleep 20  # one scrape interval (15 s) after everything is up
    checks verdict "Prometheus answers and every target is up" targets_up
    checks in_network /rehearse/pipeline_check.py lineage
    [[ $layout == replicas ]] && faults
    before="$(in_network /rehearse/pipeline_check.py counts 2>/dev/null | tail -1)"

    log "[$layout] down and up again: the volumes keep the state"
    compose down >/dev/null 2>&1
    checks verdict "up again after down" up
    after="$(in_network /rehearse/pipeline_check.py counts 2>/dev/null | tail -1)"
    checks verdict "the topics kept their records over down/up ($before)" test "$before" = "$after"
    resumed() { compose logs trainer | grep -q 'resumed from checkpoint'; }
    checks verdict "the trainer resumed from its checkpoint" wait_for 300 resumed
    version="$(.venv/bin/python -c 'import json,sys; print(json.loads(sys.argv[1])["weights"] + 1)' "$after")"
    checks .venv/bin/python scripts/rehearse/client.py talk "$proxy/v1" --sessions 3 --turns 3 --tag b
    checks in_network /rehearse/pipeline_check.py flow "$version" --within 900
    checks in_network /rehearse/pipeline_check.py gate "$version" --within 600
    checks in_network /rehearse/pipeline_check.py lineage
    [[ $failures -eq 0 ]] || compose logs --tail 40 trainer proxy
    log "[$layout] $(( $(date +%s) - layout_started )) s"
    if [[ -z "${REHEARSE_KEEP:-}" ]]; then compose down -v --remove-orphans >/dev/null 2>&1; fi
done

printf '\n%s\n' "rehearsal: ${#results[@]} checks, $failures failed, $(( $(date +%s) - started )) s"
for line in "${results[@]}"; do printf '  %s\n' "$line"; done
[[ $failures -eq 0 ]]
