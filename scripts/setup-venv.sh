#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and link it at .venv.
# The venv lives in the cache, keyed by the hash of requirements.lock and the Python version, so an unchanged
# lock never reinstalls; the project itself is (re)installed editable, which takes a second.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"

PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
    || die "Python 3.11 is required (set PYTHON=/path/to/python3.11)"

key="$( (cat requirements.lock; "$PYTHON" -c 'import sys; print(sys.version)') | sha256sum | cut -c1-16)"
venv="$TURNSTREAM_CACHE/venv-$key"
uv="$(ensure_uv)"
export UV_CACHE_DIR="$TURNSTREAM_CACHE/uv-cache" UV_LINK_MODE=copy

if [[ ! -f "$venv/.complete" ]]; then
    log "installing locked dependencies into $venv (first run downloads torch: a few minutes)"
    rm -rf "$venv"
    "$uv" venv --quiet --python "$PYTHON" "$venv"
    "$uv" pip sync --quiet --python "$venv/bin/python" requirements.lock
    touch "$venv/.complete"
fi
"$uv" pip install --quiet --python "$venv/bin/python" --no-deps --no-build-isolation -e . 2>/dev/null \
    || "$uv" pip install --quiet --python "$venv/bin/python" --no-deps -e .

if [[ "$(readlink .venv 2>/dev/null || true)" != "$venv" ]]; then
    rm -rf .venv
    ln -s "$venv" .venv
fi
log "venv ready: .venv -> $venv"
