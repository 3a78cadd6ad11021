#!/usr/bin/env bash
# Lint (`make lint`, and the first step of `make test`): ruff's checks and formatting over everything, mypy's
# type check over the contract, the runtime and the services (settings in pyproject.toml). Assumes .venv exists.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"

log "ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
log "mypy"
.venv/bin/mypy
