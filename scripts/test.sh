#!/usr/bin/env bash
# The test command (README, `make test`, .ci/run): set everything up, lint, run the whole suite against the real
# Kafka broker and Redis server (the fixtures start them unless TURNSTREAM_KAFKA_BOOTSTRAP/TURNSTREAM_REDIS_URL
# point at running ones). Extra arguments go to pytest. Fails when no test ran (pytest's exit code 5).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"

bash scripts/setup-venv.sh
bash scripts/setup-sglang.sh
bash scripts/kafka.sh install
bash scripts/redis.sh install
bash scripts/chromium.sh install
bash scripts/openclaw.sh install   # stock OpenClaw, a tested client (tests/clients)
bash scripts/agents.sh install     # Codex CLI, Claude Code, opencode: tested clients too

export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

bash scripts/lint.sh

# Two lanes on the two cores (tests/lanes.py): the tests that use an SGLang server on one xdist worker, the rest on
# the other. TURNSTREAM_TEST_LANES=0 runs everything in one process.
lanes=(--lanes)
[[ "${TURNSTREAM_TEST_LANES:-1}" == 0 ]] && lanes=()
log "pytest ${lanes[*]}"
set +e
.venv/bin/python -m pytest "${lanes[@]}" --durations=15 "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
    log "error: pytest collected no tests; that is a failure, not a pass"
    exit 1
fi
exit $rc
