#!/usr/bin/env bash
# The main job on the embedded defaults (README, `make run`): set up, start Kafka and Redis on loopback, create
# the topics, and start the pipeline's services. Services that later issues build are listed, not faked.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"

bash scripts/setup-venv.sh
bash scripts/kafka.sh start
bash scripts/redis.sh start
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
export TURNSTREAM_KAFKA_BOOTSTRAP="${TURNSTREAM_KAFKA_BOOTSTRAP:-127.0.0.1:${KAFKA_PORT:-9092}}"
export TURNSTREAM_REDIS_URL="${TURNSTREAM_REDIS_URL:-redis://127.0.0.1:${REDIS_PORT:-6379}/0}"
export TURNSTREAM_LOGGING_FORMAT="${TURNSTREAM_LOGGING_FORMAT:-text}"

.venv/bin/turnstream topics create
cat >&2 <<'MSG'

turnstream: the foundation is up (Kafka, Redis, topics). The pipeline's services are not built yet:
  engine (issue 3), proxy + pairer + reloader (issue 4), judge + teacher (issue 5), dispatcher (issue 6),
  trainer (issue 7), `turnstream run` (issue 8).
Stop the local services with: make services-down
MSG
