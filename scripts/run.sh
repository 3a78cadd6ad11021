#!/usr/bin/env bash
# The main job on the embedded defaults (README, `make run`): set up the venv, then `turnstream run`, which starts
# local Kafka and Redis on loopback, creates the topics, fetches SmolLM2, and runs the policy engine (30000), a
# fixed judge/teacher engine (30002), the proxy (8000), pairer, judge (rules backend), teacher, dispatcher
# (combine), trainer and two simulated users with live progress until Ctrl-C. Logs: $TURNSTREAM_CACHE/run/<time>/. Extra arguments go
# to `turnstream run` (e.g. --judge-backend engine). ENGINE_PORT and PROXY_PORT still work.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"

bash scripts/setup-venv.sh
bash scripts/setup-sglang.sh
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
export TURNSTREAM_LOGGING_FORMAT="${TURNSTREAM_LOGGING_FORMAT:-text}"
[[ -n "${ENGINE_PORT:-}" ]] && export TURNSTREAM_RUN_ENGINE_PORT="$ENGINE_PORT"
[[ -n "${PROXY_PORT:-}" ]] && export TURNSTREAM_PROXY_PORT="$PROXY_PORT"
# Two simulated users by default, so the loop visibly closes (SIMULATE=0 for none).
exec .venv/bin/turnstream run --simulate "${SIMULATE:-2}" "$@"
