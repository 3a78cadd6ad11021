#!/usr/bin/env bash
# Debian's Chromium, for the console's browser tests (Playwright drives it; PyPI's Playwright browser download is
# not used: it needs hosts these machines cannot reach).   scripts/chromium.sh install
# TURNSTREAM_CHROMIUM names another executable.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

install() {
    [[ -n "${TURNSTREAM_CHROMIUM:-}" ]] && return 0
    command -v chromium >/dev/null && return 0
    log "installing Debian's chromium with apt"
    local sudo=""; [[ $(id -u) -ne 0 ]] && sudo="sudo"
    $sudo apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends chromium >/dev/null \
        || die "apt-get install chromium failed"
}

case "${1:-install}" in
    install) install ;;
    *) die "usage: $0 install" ;;
esac
