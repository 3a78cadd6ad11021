#!/usr/bin/env bash
# The proxy's per-user keys on Kubernetes: `turnstream keys` run on a copy of the chart's keys Secret, which is
# then patched (never replaced, so Helm's labels stay). The file holds only SHA-256 digests; a new key is printed
# once, here. Every proxy reads the changed file when the kubelet updates its mounted copy (about a minute).
#
#   bash scripts/k8s/keys.sh add alice            # prints alice's key
#   bash scripts/k8s/keys.sh list
#   bash scripts/k8s/keys.sh revoke alice [--fingerprint 1a2b3c]
#
# RELEASE (default ts) and NAMESPACE (default: kubectl's) name the install; KEYS_SECRET overrides the Secret's name
# (proxy.keys.existingSecret); KUBECTL the command (default kubectl).
set -euo pipefail
source "$(dirname "$0")/../lib.sh"
cd "$REPO_ROOT"

release="${RELEASE:-ts}"
fullname="$release"
[[ "$release" == *turnstream* ]] || fullname="$release-turnstream"
secret="${KEYS_SECRET:-${fullname:0:40}-proxy-keys}"
read -r -a kubectl <<<"${KUBECTL:-kubectl}"
[[ -n "${NAMESPACE:-}" ]] && kubectl+=(--namespace "$NAMESPACE")
turnstream=turnstream
[[ -x .venv/bin/turnstream ]] && turnstream=.venv/bin/turnstream
command -v "$turnstream" >/dev/null || die "no turnstream to run: make setup (or pip install the repository) first"
[[ $# -ge 1 ]] || die "usage: keys.sh add|list|revoke [user] [--fingerprint F]"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
file="$work/keys"
"${kubectl[@]}" get secret "$secret" -o 'jsonpath={.data.keys}' | base64 -d >"$file" \
    || die "cannot read Secret $secret (RELEASE, NAMESPACE, KEYS_SECRET)"
chmod 600 "$file"
before="$(sha256sum "$file")"
"$turnstream" keys "$@" --file "$file"
if [[ "$(sha256sum "$file")" != "$before" ]]; then
    data="$(base64 -w0 "$file")"
    "${kubectl[@]}" patch secret "$secret" --type merge -p "{\"data\":{\"keys\":\"$data\"}}" >/dev/null
    log "Secret $secret updated: the proxies read it when the kubelet refreshes their copy (about a minute)"
fi
