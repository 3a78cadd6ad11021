#!/usr/bin/env bash
# The GPU smoke test: on a host with Docker, the NVIDIA container toolkit and one GPU, bring up Kafka, Redis,
# SGLang (compose.yaml's pinned image) with a small model, the proxy, and one trainer step, and check
#   1. a streamed and a non-streamed main turn are recorded with SGLang's exact ids;
#   2. their recorded log-probs equal SGLang's prefill scoring of the same ids (float32: Triton attention with
#      IEEE dots and torch's RMSNorm, scripts/gpu/compose.fp32.yaml; so to ~1e-5);
#   3. one Megatron-core training step runs on the GPU and publishes weight version 1;
#   4. the proxy's reloader has SGLang load it, and the next turn carries version 1;
#   5. with SMOKE_TRAINER_GPUS=a,b: one step on two GPUs (TP 2 over NCCL, Transformer Engine's layers where the
#      image has them), its version and both ranks' checkpoint state written; the trainer's log shows its memory
#      plan at start and the step's peak GPU memory (gpu_peak_gib), to compare with `turnstream trainer plan`;
#   6. with SMOKE_LORA=1, the one-GPU LoRA layout (compose.one-gpu.yaml) instead: SGLang with --enable-lora and its
#      GPU LoRA backend, the trainer's step publishes a PEFT adapter, the reloader loads it beside the base and the
#      next turn carries its version;
#   7. one step on one SMOKE_LONG_TOKENS-token sample (default 32768: an agent's session), its peak GPU memory
#      printed beside the memory plan's total for the same settings (scripts/gpu/long_step.py).
# It prints PASS/FAIL per check, the time taken, and exits non-zero on any failure. Under 10 minutes once the
# images are pulled and built. Everything it started is removed at the end (SMOKE_KEEP=1 keeps it).
#
#   bash scripts/gpu-smoke.sh                      # SmolLM2-135M, converted by `turnstream models fetch`
#   SMOKE_MODEL=/data/models/Qwen3-0.6B bash scripts/gpu-smoke.sh   # any HF folder (llama/qwen2/qwen3)
#   SMOKE_GPU=1 bash scripts/gpu-smoke.sh          # which GPU (default 0): SGLang and the trainer share it
#   SMOKE_TRAINER_GPUS=0,1 bash scripts/gpu-smoke.sh   # also a two-GPU trainer step (TP 2)
#   SMOKE_LORA=1 bash scripts/gpu-smoke.sh         # the one-GPU LoRA layout: adapters trained and served
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"
started=$(date +%s)

command -v docker >/dev/null || die "docker is required"
docker info >/dev/null 2>&1 || die "no Docker daemon answers"
docker compose version >/dev/null 2>&1 || die "the docker compose plugin is required"

models="$(mktemp -d "${TMPDIR:-/tmp}/turnstream-smoke.XXXX")"
if [[ -n "${SMOKE_MODEL:-}" ]]; then
    cp -r "$SMOKE_MODEL" "$models/smoke"
else
    bash scripts/setup-venv.sh
    cp -r "$(.venv/bin/turnstream models fetch smollm2 | tail -1)" "$models/smoke"
fi

project="turnstream-smoke-$$"
export COMPOSE_PROJECT_NAME="$project" MODELS_DIR="$models" POLICY_MODEL=/models/smoke
export POLICY_GPUS="${SMOKE_GPU:-0}" TRAINER_GPUS="${SMOKE_GPU:-0}" GPU="${SMOKE_GPU:-0}" POLICY_MEM_FRACTION=0.3
export POLICY_SGLANG_ARGS="--dtype float32 --attention-backend triton --max-total-tokens 16384" REASONING_PARSER="${SMOKE_REASONING_PARSER:-qwen3}"
export TURNSTREAM_NAMESPACE="smoke-$$." ROLLOUT_BATCH_SIZE=2 PROXY_PORT="${SMOKE_PROXY_PORT:-18000}"
# The secrets scripts/compose-secrets.sh would write to .env, fresh for each smoke run (Grafana is not started, but
# compose needs its password to read the file).
secret() { head -c 18 /dev/urandom | base64 | tr '+/' '-_'; }
export GRAFANA_ADMIN_PASSWORD="${GRAFANA_ADMIN_PASSWORD:-$(secret)}" CONSOLE_TOKEN="${CONSOLE_TOKEN:-$(secret)}"
export PROXY_API_KEY="${PROXY_API_KEY:-$(secret)}" ENGINE_API_KEY="${ENGINE_API_KEY:-$(secret)}"
export ENGINE_ADMIN_API_KEY="${ENGINE_ADMIN_API_KEY:-$(secret)}"
files=(-f compose.yaml)
[[ -z "${SMOKE_LORA:-}" ]] || files+=(-f compose.one-gpu.yaml)
files+=(-f scripts/gpu/compose.fp32.yaml)  # what float32 needs of SGLang on a GPU (the file says why)
compose() { docker compose "${files[@]}" "$@"; }
cleanup() {
    local rc=$?
    if [[ $rc -ne 0 ]]; then  # whatever failed (a `compose up` under set -e too): its logs before they go
        compose logs --tail 80 sglang-policy proxy trainer >&2 || true
        log "FAILED in $(( $(date +%s) - started )) s"
    fi
    if [[ -z "${SMOKE_KEEP:-}" ]]; then
        compose down -v --remove-orphans >/dev/null 2>&1 || true
        rm -rf "$models"
    else
        log "kept: COMPOSE_PROJECT_NAME=$project MODELS_DIR=$models"
    fi
}
trap cleanup EXIT
# The checks run in the proxy's container: it has every setting a service that meets a version has (with LoRA, that
# versions are adapters), and the compose network.
check() { compose run --rm --no-deps -v "$REPO_ROOT/scripts/gpu:/smoke:ro" --entrypoint python proxy /smoke/smoke_check.py "$@"; }

log "building the turnstream image and starting Kafka, Redis, SGLang and the proxy"
compose build proxy
compose up -d --wait kafka redis
compose up -d topics sglang-policy proxy
wait_for 900 curl -fsS "http://127.0.0.1:$PROXY_PORT/healthz" || die "the proxy never became healthy"
log "up after $(( $(date +%s) - started )) s"

rc=0
check turns || rc=1
if [[ $rc -eq 0 ]]; then
    log "one trainer step on the GPU"
    step_started=$(date +%s)
    compose run --rm --no-deps trainer trainer --hf-checkpoint /models/smoke --max-steps 1 || rc=1
    log "trainer step (start-up included): $(( $(date +%s) - step_started )) s"
    log "one step on one ${SMOKE_LONG_TOKENS:-32768}-token sample: peak against the plan"
    compose run --rm --no-deps -v "$REPO_ROOT/scripts/gpu:/smoke:ro" --entrypoint python trainer \
        /smoke/long_step.py --hf-checkpoint /models/smoke --tokens "${SMOKE_LONG_TOKENS:-32768}" || rc=1
    [[ $rc -eq 0 ]] && { check served 1 || rc=1; }
fi
if [[ $rc -eq 0 && -n "${SMOKE_TRAINER_GPUS:-}" ]]; then
    log "one trainer step on two GPUs (TP 2): $SMOKE_TRAINER_GPUS"
    # SmolLM2's 9 heads and 3 KV heads do not split in two: a random model with its tokenizer and vocabulary that
    # does (scripts/gpu/tp_model.py). Its own output folder and consumer group: the same two samples, a layout of
    # its own; its version 1 is announced again and the reloader, serving version 1 already, ignores it.
    compose run --rm --no-deps -v "$REPO_ROOT/scripts/gpu:/smoke:ro" --entrypoint python trainer \
        /smoke/tp_model.py /models/smoke /weights/tp2-base --tp 2 || rc=1
    TRAINER_GPUS="$SMOKE_TRAINER_GPUS" TRAINER_NPROC=2 TRAINER_TP=2 compose run --rm --no-deps \
        -e TURNSTREAM_TRAINER_OUTPUT_DIR=/weights/tp2 -e TURNSTREAM_TRAINER_GROUP_ID=smoke-tp2 \
        trainer trainer --hf-checkpoint /weights/tp2-base --max-steps 1 || rc=1
    compose run --rm --no-deps --entrypoint python trainer -c '
import pathlib, sys
root = pathlib.Path("/weights/tp2")
states = sorted(p.name for p in root.glob("checkpoints/ckpt-v1/state-rank*.pt"))
ok = (root / "versions/v1/model.safetensors").exists() and states == ["state-rank0.pt", "state-rank1.pt"]
print("PASS" if ok else "FAIL", "two-GPU step: version 1 and both ranks state", states, flush=True)
sys.exit(0 if ok else 1)' || rc=1
fi
[[ $rc -eq 0 ]] && log "PASSED in $(( $(date +%s) - started )) s"
exit $rc  # on failure the exit trap prints the logs
