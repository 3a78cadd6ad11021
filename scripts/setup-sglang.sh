#!/usr/bin/env bash
# SGLang's own virtual environment (the policy, judge and teacher engines), apart from the services' venv: SGLang
# 0.5.23 pins torch 2.14.1, transformers 5.19.0 and openai 2.8.0, the services torch 2.13.0, transformers 5.23.0
# and openai 3.x (docs/engine.md has the measured trade-off). Cached like .venv: keyed by the hash of
# scripts/sglang/requirements.lock, the SGLang version and the Python version, linked at .venv-sglang, so an
# unchanged lock never reinstalls. The GPU-only kernels are left out (scripts/sglang/requirements.in says which);
# on a GPU host SGLang runs from its docker image (compose.yaml).
#   bash scripts/setup-sglang.sh          install (or reuse) and link
#   bash scripts/setup-sglang.sh lock     re-resolve scripts/sglang/requirements.lock from requirements.in
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"

SGLANG_VERSION="$(cat scripts/sglang/version)"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
uv="$(ensure_uv)"
export UV_CACHE_DIR="$TURNSTREAM_CACHE/uv-cache" UV_LINK_MODE=copy

if [[ "${1:-}" == "lock" ]]; then
    "$uv" pip compile --quiet scripts/sglang/requirements.in --python-version 3.11 \
        --python-platform x86_64-unknown-linux-gnu -o scripts/sglang/requirements.lock
    log "locked scripts/sglang/requirements.lock"
    exit 0
fi

key="$( (cat scripts/sglang/requirements.lock; echo "$SGLANG_VERSION"; "$PYTHON" -c 'import sys; print(sys.version)') \
    | sha256sum | cut -c1-16)"
venv="$TURNSTREAM_CACHE/sglang-$key"
if [[ ! -f "$venv/.complete" ]]; then
    log "installing SGLang $SGLANG_VERSION into $venv (first run: about 6 GB, a few minutes)"
    rm -rf "$venv"
    "$uv" venv --quiet --python "$PYTHON" "$venv"
    "$uv" pip sync --quiet --python "$venv/bin/python" scripts/sglang/requirements.lock
    "$uv" pip install --quiet --python "$venv/bin/python" --no-deps "sglang==$SGLANG_VERSION"
    touch "$venv/.complete"
fi
if [[ "$(readlink .venv-sglang 2>/dev/null || true)" != "$venv" ]]; then
    rm -rf .venv-sglang
    ln -s "$venv" .venv-sglang
fi
log "SGLang ready: .venv-sglang -> $venv"
