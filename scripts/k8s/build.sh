#!/usr/bin/env bash
# Build a single-node Kubernetes from the Go module proxy, once, into the cache (make rehearse-k8s; docs/kubernetes.md):
# kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kube-proxy and kubectl at v1.37.2, etcd v3.6.16,
# helm v4.3.2, CoreDNS v1.14.7 and kube-router v2.1.0 (its firewall enforces NetworkPolicy). Prints the bin folder.
# About 25 minutes cold on two cores, seconds when built.
#   bash scripts/k8s/build.sh [kubernetes] [etcd] [helm] [coredns] [netpol]      (default: all)
#
# Why a wrapper module: k8s.io/kubernetes replaces every k8s.io/* staging module with ./staging/..., which
# `go install pkg@version` refuses. The wrapper requires k8s.io/kubernetes and replaces each staging module with its
# published v0.x twin (the same source, tagged with the release); the three sample-* modules, which the proxy refuses
# and nothing built here imports, become empty local stubs. etcd's server module has relative replaces too: same.
set -euo pipefail
source "$(dirname "$0")/../lib.sh"

K8S_VERSION="${K8S_VERSION:-v1.37.2}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.16}"
HELM_VERSION="${HELM_VERSION:-v4.3.2}"
COREDNS_VERSION="${COREDNS_VERSION:-v1.14.7}"
KUBE_ROUTER_VERSION="${KUBE_ROUTER_VERSION:-v2.1.0}" # the one version the module proxy serves (advisories exist
# against it; it runs only inside the rehearsal's network namespace, which has no route out)
STAGING_VERSION="v0.${K8S_VERSION#v1.}"
HOME_DIR="$TURNSTREAM_CACHE/k8s-$K8S_VERSION"
BIN="$HOME_DIR/bin"
export GOFLAGS="-mod=mod -buildvcs=false -trimpath" GOTOOLCHAIN=local CGO_ENABLED=0
# Go caches of our own (never a GOPATH or GOCACHE the caller set: the end of this script deletes these)
export GOPATH="$TURNSTREAM_CACHE/go" GOCACHE="$TURNSTREAM_CACHE/go-build"
# one package at a time: a kubelet link peaks near 3 GB, two at once could crowd the tests on a 24 GiB machine
BUILD_P="${K8S_BUILD_P:-1}"
mkdir -p "$BIN"

K8S_CMDS=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl)

# wrapper DIR MODULE VERSION SOURCE_DIR: a go.mod requiring MODULE@VERSION that maps its relative replaces to
# published versions (module => module STAGING) or, where the proxy has none, to empty stubs.
wrapper() {
    local dir="$1" module="$2" version="$3" src="$4" published="$5"
    shift 5
    local stubs=("$@")
    mkdir -p "$dir"
    {
        printf 'module turnstream.local/build\n\ngo %s\n\nrequire %s %s\n\nreplace (\n' \
            "$(awk '/^go /{print $2; exit}' "$src/go.mod")" "$module" "$version"
        # every `x => ./relative` line of the module's own go.mod
        sed -n '/^replace (/,/^)/p; /^replace [^(]/p' "$src/go.mod" \
            | awk '$2 == "=>" && $3 ~ /^\.\.?\// {print $1}' | sort -u | while read -r dep; do
                local stub=""
                for s in "${stubs[@]}"; do [[ "$dep" == "$s" ]] && stub=1; done
                if [[ -n "$stub" ]]; then
                    printf '\t%s => ./stub/%s\n' "$dep" "${dep##*/}"
                else
                    printf '\t%s => %s %s\n' "$dep" "$dep" "$(published_version "$dep" "$published")"
                fi
            done
        printf ')\n'
    } >"$dir/go.mod"
    for s in "${stubs[@]}"; do
        mkdir -p "$dir/stub/${s##*/}"
        printf 'module %s\n\ngo 1.24\n' "$s" >"$dir/stub/${s##*/}/go.mod"
    done
    printf 'package build\n' >"$dir/build.go"
}

# the version a relatively replaced module is published at: Kubernetes staging modules at v0.<minor>.<patch>;
# etcd's own modules at the release's version
published_version() {
    case "$2" in
        staging) printf '%s\n' "$STAGING_VERSION" ;;
        *) printf '%s\n' "$2" ;;
    esac
}

built() { for b in "$@"; do [[ -x "$BIN/$b" ]] || return 1; done; }
wanted=("$@")
[[ ${#wanted[@]} -gt 0 ]] || wanted=(kubernetes etcd helm coredns netpol)
want() { [[ " ${wanted[*]} " == *" $1 "* ]]; }

if want kubernetes && ! built "${K8S_CMDS[@]}"; then
    log "building Kubernetes $K8S_VERSION (${K8S_CMDS[*]}) from the Go module proxy into $BIN (cold: ~20 minutes)"
    src="$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | awk -F'"' '/"Dir"/{print $4}')"
    dir="$HOME_DIR/wrap-kubernetes"
    wrapper "$dir" k8s.io/kubernetes "$K8S_VERSION" "$src" staging \
        k8s.io/sample-apiserver k8s.io/sample-cli-plugin k8s.io/sample-controller
    for cmd in "${K8S_CMDS[@]}"; do
        [[ -x "$BIN/$cmd" ]] && continue
        log "  $cmd"
        (cd "$dir" && go build -p "$BUILD_P" -ldflags "-s -w \
            -X k8s.io/component-base/version.gitVersion=$K8S_VERSION \
            -X k8s.io/component-base/version.gitMajor=1 \
            -X k8s.io/component-base/version.gitMinor=$(cut -d. -f2 <<<"$K8S_VERSION") \
            -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION" \
            -o "$BIN/$cmd.tmp" "k8s.io/kubernetes/cmd/$cmd") && mv "$BIN/$cmd.tmp" "$BIN/$cmd"
    done
fi

if want etcd && ! built etcd; then
    log "building etcd $ETCD_VERSION"
    src="$(go mod download -json "go.etcd.io/etcd/server/v3@$ETCD_VERSION" | awk -F'"' '/"Dir"/{print $4}')"
    dir="$HOME_DIR/wrap-etcd"
    wrapper "$dir" go.etcd.io/etcd/server/v3 "$ETCD_VERSION" "$src" "$ETCD_VERSION"
    (cd "$dir" && go build -p "$BUILD_P" -ldflags "-s -w" -o "$BIN/etcd.tmp" go.etcd.io/etcd/server/v3) \
        && mv "$BIN/etcd.tmp" "$BIN/etcd"
fi

if want helm && ! built helm; then
    log "building helm $HELM_VERSION"
    GOBIN="$HOME_DIR/gobin" go install -p "$BUILD_P" -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$HELM_VERSION" \
        "helm.sh/helm/v4/cmd/helm@$HELM_VERSION"
    mv "$HOME_DIR/gobin/helm" "$BIN/helm"
fi

if want coredns && ! built coredns; then
    log "building CoreDNS $COREDNS_VERSION"
    GOBIN="$HOME_DIR/gobin" go install -p "$BUILD_P" -ldflags "-s -w" "github.com/coredns/coredns@$COREDNS_VERSION"
    mv "$HOME_DIR/gobin/coredns" "$BIN/coredns"
fi

if want netpol && ! built kube-router; then
    log "building kube-router $KUBE_ROUTER_VERSION"
    GOBIN="$HOME_DIR/gobin" go install -p "$BUILD_P" -ldflags "-s -w" \
        "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router@$KUBE_ROUTER_VERSION"
    mv "$HOME_DIR/gobin/kube-router" "$BIN/kube-router"
fi

# The Go caches (the compile cache about 6 GB, the modules about 3 GB) are not needed once the binaries exist, and
# the rehearsal needs the disk: containerd keeps each imported image twice (docs/kubernetes.md). A rebuild (another
# version) downloads the modules again: minutes of the ~20 cold.
if built "${K8S_CMDS[@]}" etcd helm coredns kube-router; then
    if [[ -d "$GOPATH" ]]; then chmod -R u+w "$GOPATH"; fi  # the module cache is read-only
    rm -rf "$GOCACHE" "$GOPATH"
fi
printf '%s\n' "$BIN"
