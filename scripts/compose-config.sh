#!/usr/bin/env bash
# Validate and resolve compose files as `docker compose config` does; prints the resolved project as JSON.
#   bash scripts/compose-config.sh [compose.yaml ...]
# Uses the real `docker compose config` where the compose plugin is installed, or where `make rehearse`
# (scripts/rehearse/engine.sh) has built it into the cache; the plugin needs no daemon for this. Elsewhere it builds
# scripts/compose-check: the same loader, compose-go, from the Go module proxy, cached by the hash of its sources.
# Needs Go >= 1.26 (found on PATH or in /usr/local/go).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"

files=("$@")
[[ ${#files[@]} -gt 0 ]] || files=(compose.yaml)

args=()
for f in "${files[@]}"; do args+=(-f "$f"); done
if docker compose version >/dev/null 2>&1; then
    exec docker compose "${args[@]}" config --format json
fi
plugin="$TURNSTREAM_CACHE/docker/config/cli-plugins/docker-compose"
if [[ -x "$plugin" ]]; then
    exec "$plugin" "${args[@]}" config --format json
fi

src=scripts/compose-check
key="$(cat "$src/go.mod" "$src/go.sum" "$src/main.go" | sha256sum | cut -c1-16)"
bin="$TURNSTREAM_CACHE/bin/compose-check-$key"
if [[ ! -x "$bin" ]]; then
    command -v go >/dev/null || PATH="$PATH:/usr/local/go/bin"
    command -v go >/dev/null || die "Go is needed to build scripts/compose-check (no docker compose plugin here)"
    log "building the compose validator (compose-go) into $bin"
    mkdir -p "$(dirname "$bin")"
    (cd "$src" && go build -trimpath -o "$bin.tmp" .) && mv "$bin.tmp" "$bin"
fi
exec "$bin" "${files[@]}"
