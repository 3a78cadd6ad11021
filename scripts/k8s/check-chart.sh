#!/usr/bin/env bash
# The Helm chart (deploy/helm/turnstream) checked for every values file: `helm lint`, `helm template`, and, when
# the rehearsal's cluster is up (scripts/k8s/cluster.sh start), a server-side dry run of what it renders against
# that cluster's own API (every object validated by the API server, nothing created). Prints PASS/FAIL lines.
#   bash scripts/k8s/check-chart.sh [--server]
set -euo pipefail
source "$(dirname "$0")/../lib.sh"
cd "$REPO_ROOT"
BIN="$(bash scripts/k8s/build.sh helm)"
CHART=deploy/helm/turnstream
server=""
[[ "${1:-}" == --server ]] && server=1
failed=0
out="$(mktemp -d)"
for values in "$CHART"/values/*.yaml; do
    name="$(basename "$values" .yaml)"
    if "$BIN/helm" lint "$CHART" -f "$values" >"$out/$name.lint" 2>&1; then
        echo "PASS helm lint ($name)"
    else
        echo "FAIL helm lint ($name)"; tail -5 "$out/$name.lint" >&2; failed=1
    fi
    if "$BIN/helm" template ts "$CHART" -f "$values" --namespace turnstream-check >"$out/$name.yaml" 2>"$out/$name.err"; then
        echo "PASS helm template ($name): $(grep -c '^kind:' "$out/$name.yaml") objects"
    else
        echo "FAIL helm template ($name)"; tail -5 "$out/$name.err" >&2; failed=1; continue
    fi
    # Pod Security `restricted` for every pod, the models from a claim (a hostPath volume is never admitted)
    if "$BIN/helm" template ts "$CHART" -f "$values" --set models.existingClaim=models \
        | .venv/bin/python scripts/k8s/pod_security.py >"$out/$name.psa" 2>&1; then
        echo "PASS Pod Security restricted ($name): $(tail -1 "$out/$name.psa")"
    else
        echo "FAIL Pod Security restricted ($name)"; head -8 "$out/$name.psa" >&2; failed=1
    fi
    if [[ -n "$server" ]]; then
        if bash scripts/k8s/cluster.sh in kubectl apply --dry-run=server -n default -f - \
            <"$out/$name.yaml" >"$out/$name.dry" 2>&1; then
            echo "PASS server-side dry run ($name)"
        else
            echo "FAIL server-side dry run ($name)"; grep -i error "$out/$name.dry" | head -5 >&2; failed=1
        fi
    fi
done
rm -rf "$out"
exit "$failed"
