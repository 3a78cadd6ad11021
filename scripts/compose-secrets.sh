#!/usr/bin/env bash
# Make the secrets compose.yaml needs, once: writes each missing one to .env beside compose.yaml (created 0600),
# which `docker compose` reads by itself. Values already in .env (or set in the environment) are kept.
#   bash scripts/compose-secrets.sh            # then: docker compose up -d --build
#   docker compose --env-file .env --env-file deploy/recipes/one-gpu-lora.env up -d --build   # with a recipe
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"

file="${COMPOSE_SECRETS_FILE:-.env}"
umask 077
touch "$file"
chmod 600 "$file"
made=()
# Redis: a password per ACL user (runtime/security/redis_users.py's NAMES).
redis_users=(ADMIN REPLICA SENTINEL CLIENT PROXY PAIRER DISPATCHER JUDGE TEACHER TRAINER GATE TOPICS SIMULATE EVAL CONSOLE)
# Kafka: the operator, the controllers' login and a SCRAM user per service (runtime/security/kafka_users.py's NAMES).
kafka_users=(ADMIN CONTROLLER PROXY PAIRER JUDGE TEACHER DISPATCHER TRAINER EVAL GATE CONSOLE)
for name in GRAFANA_ADMIN_PASSWORD CONSOLE_TOKEN PROXY_API_KEY ENGINE_API_KEY ENGINE_ADMIN_API_KEY \
    "${redis_users[@]/#/REDIS_PASSWORD_}" "${kafka_users[@]/#/KAFKA_PASSWORD_}"; do
    if grep -q "^${name}=" "$file" || [[ -n "${!name:-}" ]]; then
        continue
    fi
    value="$(head -c 24 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n')"
    printf '%s=%s\n' "$name" "$value" >>"$file"
    made+=("$name")
done
if [[ ${#made[@]} -gt 0 ]]; then
    log "wrote ${made[*]} to $file (0600). Clients send Authorization: Bearer \$PROXY_API_KEY; the console's login"
    log "link is http://127.0.0.1:\${CONSOLE_PORT:-8080}/login?token=\$CONSOLE_TOKEN"
else
    log "$file already holds every secret compose.yaml needs"
fi
