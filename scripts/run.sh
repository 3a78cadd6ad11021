#!/usr/bin/env bash
# The main job on the embedded defaults (README, `make run`): set up, start Kafka and Redis on loopback, create
# the topics, then run the parts of the pipeline that are built (policy engine, proxy with reloader, pairer,
# judge with the rules backend, teacher engine and teacher worker, dispatcher in combine mode, trainer) in the
# foreground until Ctrl-C. Parts that later issues build are listed, not faked.
# Ports: ENGINE_PORT (30000), TEACHER_PORT (30002), PROXY_PORT (8000), metrics of pairer/judge/teacher/dispatcher/
# trainer on 9101-9105; logs under $TURNSTREAM_CACHE/run/.
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
ENGINE_PORT="${ENGINE_PORT:-30000}"
PROXY_PORT="${PROXY_PORT:-8000}"
TEACHER_PORT="${TEACHER_PORT:-30002}"
export TURNSTREAM_ENGINE_URL="http://127.0.0.1:$ENGINE_PORT"
export TURNSTREAM_PROXY_PORT="$PROXY_PORT"
LOGS="$TURNSTREAM_CACHE/run"
mkdir -p "$LOGS"

.venv/bin/turnstream topics create
model="$(.venv/bin/turnstream models fetch smollm2)"

pids=()
cleanup() {
    trap - INT TERM EXIT
    log "stopping the services (Kafka and Redis keep running: make services-down)"
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
}
trap cleanup INT TERM EXIT

.venv/bin/turnstream engine --model "$model" --port "$ENGINE_PORT" --served-model-name smollm2 \
    >"$LOGS/engine.log" 2>&1 &
pids+=($!)
wait_for 180 curl -sf "http://127.0.0.1:$ENGINE_PORT/health" || die "the engine did not start (log: $LOGS/engine.log)"
.venv/bin/turnstream proxy >"$LOGS/proxy.log" 2>&1 &
pids+=($!)
TURNSTREAM_METRICS_PORT=9101 .venv/bin/turnstream pairer >"$LOGS/pairer.log" 2>&1 &
pids+=($!)
# The judge: deterministic keyword rules on the CPU (point judge.backend=engine at a judge model on a GPU host).
TURNSTREAM_METRICS_PORT=9102 .venv/bin/turnstream judge --backend rules >"$LOGS/judge.log" 2>&1 &
pids+=($!)
# The teacher: its own engine with the starting weights, never reloaded.
.venv/bin/turnstream engine --model "$model" --port "$TEACHER_PORT" --served-model-name smollm2-teacher \
    >"$LOGS/teacher-engine.log" 2>&1 &
pids+=($!)
wait_for 180 curl -sf "http://127.0.0.1:$TEACHER_PORT/health" \
    || die "the teacher engine did not start (log: $LOGS/teacher-engine.log)"
TURNSTREAM_METRICS_PORT=9103 .venv/bin/turnstream teacher --engine-url "http://127.0.0.1:$TEACHER_PORT" \
    >"$LOGS/teacher.log" 2>&1 &
pids+=($!)
TURNSTREAM_METRICS_PORT=9104 .venv/bin/turnstream dispatcher >"$LOGS/dispatcher.log" 2>&1 &
pids+=($!)
# The trainer: Megatron-core on the CPU; every rollout_batch_size (16) samples it publishes a weight version
# under $TURNSTREAM_CACHE/weights, which the proxy's reloader loads into the policy engine.
TURNSTREAM_METRICS_PORT=9105 TURNSTREAM_TRAINER_HF_CHECKPOINT="$model" .venv/bin/turnstream trainer \
    >"$LOGS/trainer.log" 2>&1 &
pids+=($!)
wait_for 60 curl -sf "http://127.0.0.1:$PROXY_PORT/healthz" || die "the proxy did not start (log: $LOGS/proxy.log)"

cat >&2 <<MSG

turnstream is serving an OpenAI-compatible API at http://127.0.0.1:$PROXY_PORT/v1 (SmolLM2-135M on the CPU).
Every main-line turn is recorded on Kafka topic 'turns', paired on 'turns.paired', judged on 'judgments'
(rules judge), scored by the teacher on 'teacher' when its hint is accepted, and turned into a training sample
on 'samples' (combine mode) when it teaches something; every 16 samples the trainer publishes a new weight
version on 'weights' and the engine loads it while it keeps serving. Try:

  curl -s http://127.0.0.1:$PROXY_PORT/v1/chat/completions -H 'content-type: application/json' \\
       -H 'X-Session-Id: demo' -d '{"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 32}'

Not built yet: \`turnstream run\`, compose and replay (issue 8). Logs: $LOGS.
Ctrl-C stops the services.
MSG
wait -n "${pids[@]}"
die "a service exited; see $LOGS"
