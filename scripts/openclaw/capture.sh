#!/usr/bin/env bash
# Record what stock OpenClaw sends to an OpenAI-compatible server: runs scripts/openclaw/capture_server.py and
# drives headless OpenClaw turns through it, writing one JSONL file per scenario (one request a line).
#   bash scripts/openclaw/capture.sh [OUT_DIR]      (default tests/services/proxy/fixtures/openclaw)
# Scenarios: default.jsonl (default config; sessions S1, S2 interleaved, 3 messages each), lean.jsonl (--lean,
# same), lean-affinity.jsonl (--lean --affinity; session S1, 3 messages), tools.jsonl (default config with the
# server's --mode tools: reasoning_content on every reply and a tool call (`ls`) answering each request without a
# tool result, text padded with whitespace; session S1, 3 messages), think.jsonl (--lean with the server's
# --mode think: replies carry an inline <think>...</think> block; session S1, 3 messages), empty.jsonl (--lean with
# the server's --mode empty: requests 1 and 3 are answered with nothing, and OpenClaw retries each with an
# instruction; session S1, 3 messages). Wall time per turn
# goes to stderr and OUT_DIR/timings.tsv.
# Settings: CAPTURE_PORT (8011), CAPTURE_SCENARIOS ("default lean lean-affinity tools think empty"), TURNSTREAM_CACHE.
set -euo pipefail
source "$(dirname "$0")/../lib.sh"
cd "$REPO_ROOT"

out_dir="$(mkdir -p "${1:-tests/services/proxy/fixtures/openclaw}" && cd "${1:-tests/services/proxy/fixtures/openclaw}" && pwd)"
port="${CAPTURE_PORT:-8011}"
python="$REPO_ROOT/.venv/bin/python"
[[ -x "$python" ]] || die "$python is missing: run scripts/setup-venv.sh"
bash scripts/openclaw.sh install

scratch="$(mktemp -d "${TMPDIR:-/tmp}/openclaw-capture.XXXX")"
server_pid=""
cleanup() {
    [[ -n "$server_pid" ]] && kill "$server_pid" 2>/dev/null || true
    rm -rf "$scratch"
}
trap cleanup EXIT

messages=("What is 2+2?" "No, answer in one word." "Thanks.")
timings="$out_dir/timings.tsv"
printf 'scenario\tsession\tmessage\trc\twall_s\n' >"$timings"

# scenario NAME SERVER_MODE "CONFIG FLAGS" SESSION...: a fresh capture and state folder; the sessions' turns
# interleaved.
scenario() {
    local name="$1" mode="$2" flags="$3"; shift 3
    local capture="$out_dir/$name.jsonl" state="$scratch/$name"
    : >"$capture"
    "$python" scripts/openclaw/capture_server.py --port "$port" --out "$capture" --mode "$mode" >"$scratch/$name.server.log" 2>&1 &
    server_pid=$!
    wait_for 20 curl -sf "http://127.0.0.1:$port/v1/models" || die "the capture server did not start (see $scratch/$name.server.log)"
    # shellcheck disable=SC2086
    bash scripts/openclaw.sh config "$state" "http://127.0.0.1:$port/v1" $flags
    local message session start rc
    for message in "${messages[@]}"; do
        for session in "$@"; do
            start=$(date +%s.%N); rc=0
            bash scripts/openclaw.sh agent "$state" "$session" "$message" >"$scratch/$name.$session.out.json" \
                2>>"$scratch/$name.agent.log" || rc=$?
            local wall; wall=$(printf '%.2f' "$(echo "$(date +%s.%N) - $start" | bc)")
            printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$session" "$message" "$rc" "$wall" >>"$timings"
            log "$name $session \"$message\": rc=$rc ${wall}s"
            [[ $rc -eq 0 ]] || { tail -20 "$scratch/$name.agent.log" >&2; die "openclaw agent failed"; }
        done
    done
    kill "$server_pid"; wait "$server_pid" 2>/dev/null || true; server_pid=""
    log "$name: $(wc -l <"$capture") requests, $(wc -c <"$capture") bytes in $capture"
}

for name in ${CAPTURE_SCENARIOS:-default lean lean-affinity tools think empty}; do
    case "$name" in
        default) scenario default text "" S1 S2 ;;
        lean) scenario lean text "--lean" S1 S2 ;;
        lean-affinity) scenario lean-affinity text "--lean --affinity" S1 ;;
        tools) scenario tools tools "" S1 ;;
        think) scenario think think "--lean" S1 ;;
        empty) scenario empty empty "--lean" S1 ;;
        *) die "unknown scenario $name" ;;
    esac
done
