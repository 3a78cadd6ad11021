#!/usr/bin/env bash
# Local stand-ins for the images compose.yaml pulls from Docker Hub, which cannot be reached here; each is built
# once and kept (tagged by the hash of what it is built from). The Docker daemon and the exports of
# scripts/rehearse/engine.sh are expected.
#   bash scripts/rehearse/images.sh [base kafka redis prometheus sglang]    (default: all)
#
#   turnstream-rehearse/debian-base:bookworm     Debian bookworm by mmdebstrap from this machine's apt sources, then
#                                                `docker import`: python3.11 (as `python` too), pip, ca-certificates
#                                                with this machine's extra CAs (its HTTPS egress proxy), curl; the
#                                                stand-in for python:3.11-slim that turnstream's Dockerfile builds on
#   turnstream-rehearse/kafka:4.4.0              the jars scripts/kafka.sh assembles, Debian's Java 17 (images/kafka)
#   turnstream-rehearse/redis:7                  Debian's redis-server (images/redis)
#   turnstream-rehearse/prometheus:v3.5.0        Debian's prometheus 2.42 with upstream's entrypoint (images/prometheus)
#   turnstream-rehearse/sglang:v0.5.23-cpu       SGLang from scripts/sglang/requirements.lock and the CPU stand-in
set -euo pipefail
source "$(dirname "$0")/../lib.sh"
cd "$REPO_ROOT"
HERE=scripts/rehearse/images
BASE=turnstream-rehearse/debian-base:bookworm
wanted=("$@")
[[ ${#wanted[@]} -gt 0 ]] || wanted=(base kafka redis prometheus sglang)

key_of() { cat "$@" | sha256sum | cut -c1-12; }
have() { [[ "$(docker image inspect -f '{{index .Config.Labels "turnstream.key"}}' "$1" 2>/dev/null)" == "$2" ]]; }

build_base() {
    local key; key="$(key_of "$0" /etc/apt/sources.list.d/debian.sources /usr/local/share/ca-certificates/*.crt)"
    have "$BASE" "$key" && return 0
    command -v mmdebstrap >/dev/null || {
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null
    }
    local tar; tar="$(mktemp --suffix .tar)"
    log "making $BASE with mmdebstrap"
    mmdebstrap --quiet --variant=minbase --mode=root \
        --include=python3,python3-pip,python3-venv,python-is-python3,ca-certificates,curl,passwd,procps \
        --customize-hook='mkdir -p "$1/usr/local/share/ca-certificates"' \
        --customize-hook='cp /usr/local/share/ca-certificates/*.crt "$1/usr/local/share/ca-certificates/"' \
        --customize-hook='chroot "$1" update-ca-certificates >/dev/null' \
        --customize-hook='rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
        bookworm "$tar" /etc/apt/sources.list.d/debian.sources
    docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8 SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
        --change "LABEL turnstream.key=$key" \
        --change 'CMD ["bash"]' "$tar" "$BASE" >/dev/null
    rm -f "$tar"
}

build() {  # build NAME TAG CONTEXT [docker build args...]
    local name="$1" tag="$2" context="$3"; shift 3
    local key; key="$(cd "$context" && find . -type f | sort | xargs cat | cat - <(docker image inspect -f '{{.Id}}' "$BASE") | sha256sum | cut -c1-12)"
    have "$tag" "$key" && return 0
    log "building $tag"
    local t0; t0=$(date +%s)
    docker build -q --build-arg BASE_IMAGE="$BASE" --label "turnstream.key=$key" -t "$tag" "$@" "$context" >/dev/null
    log "$tag built in $(( $(date +%s) - t0 )) s"
}

context() {  # a throw-away build context: the image's own files plus what it copies from the repository
    local dir; dir="$(mktemp -d)"; cp -r "$HERE/$1/." "$dir/"; printf '%s\n' "$dir"
}

for name in "${wanted[@]}"; do
    case "$name" in
        base) build_base ;;
        kafka)
            bash scripts/kafka.sh install
            pom_key="$(sha256sum scripts/kafka/pom.xml | cut -c1-12)"
            version="$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' scripts/kafka/pom.xml)"
            ctx="$(context kafka)"
            cp -r "$TURNSTREAM_CACHE/kafka/$version-$pom_key/libs" "$ctx/libs"; rm -f "$ctx/libs/.complete"
            cp scripts/kafka/log4j2.properties "$ctx/"
            build kafka "turnstream-rehearse/kafka:$version" "$ctx"; rm -rf "$ctx" ;;
        redis) build redis turnstream-rehearse/redis:7 "$HERE/redis" ;;
        prometheus) build prometheus turnstream-rehearse/prometheus:v3.5.0 "$HERE/prometheus" ;;
        sglang)
            version="$(cat scripts/sglang/version)"
            ctx="$(context sglang)"
            cp scripts/sglang/requirements.lock "$ctx/"; cp -r services/engine/standin "$ctx/standin"
            find "$ctx/standin" -name __pycache__ -prune -exec rm -rf {} +
            build sglang "turnstream-rehearse/sglang:v$version-cpu" "$ctx" --build-arg SGLANG_VERSION="$version"
            rm -rf "$ctx" ;;
        *) die "unknown image $name" ;;
    esac
done
docker image ls --format '{{.Repository}}:{{.Tag}}\t{{.Size}}' | grep '^turnstream-rehearse/' | sort >&2
