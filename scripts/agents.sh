#!/usr/bin/env bash
# The coding agents people run today, from npm, driven headless through turnstream's proxy as their users run them.
#   scripts/agents.sh install                               Node 24 + Codex CLI, Claude Code, opencode into the cache
#   scripts/agents.sh AGENT DIR BASE_URL MESSAGE [--again]  one headless turn of AGENT (codex | claude | opencode)
#                                                           in the conversation kept in DIR (its home, config and
#                                                           working folder, made on first use); --again continues
#                                                           DIR's conversation (codex exec resume --last, claude -p
#                                                           --continue, opencode run --continue); the agent's
#                                                           output on stdout, its exit code passed through
#   scripts/agents.sh path                                  print the PATH prefix with Node 24 and the agents
# BASE_URL is the proxy's address without /v1 (http://127.0.0.1:8000). The key is TURNSTREAM_API_KEY
# ("turnstream-local" when unset: a proxy without keys takes any).
# What each is given is what makes its prompt fit an 8,192-token model (docs/clients.md): Codex a one-line
# instructions file, no environment context and the default features that add tools off (three tools stay, about
# 2k tokens); Claude Code --bare with a one-line system prompt and no tools; opencode its defaults.
# Settings: AGENTS_MAX_TOKENS (Claude Code's CLAUDE_CODE_MAX_OUTPUT_TOKENS, 256), CODEX_VERSION (0.171.0),
#           CLAUDE_CODE_VERSION (2.1.332), OPENCODE_VERSION (1.18.33), AGENTS_TIMEOUT (seconds per turn, 300),
#           TURNSTREAM_CACHE.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

NODE_VERSION="${OPENCLAW_NODE_VERSION:-24.22.3}"
NODE_HOME="$TURNSTREAM_CACHE/node-$NODE_VERSION"
CODEX_VERSION="${CODEX_VERSION:-0.171.0}"
CLAUDE_CODE_VERSION="${CLAUDE_CODE_VERSION:-2.1.332}"
OPENCODE_VERSION="${OPENCODE_VERSION:-1.18.33}"
AGENTS_HOME="$TURNSTREAM_CACHE/agents-codex$CODEX_VERSION-claude$CLAUDE_CODE_VERSION-opencode$OPENCODE_VERSION"
BIN="$AGENTS_HOME/node_modules/.bin"
INSTRUCTIONS="You are a helpful assistant. Answer briefly."

install() {
    ensure_node "$NODE_VERSION" >/dev/null
    if [[ ! -x "$BIN/codex" || ! -x "$BIN/claude" || ! -x "$BIN/opencode" ]]; then
        command -v npm >/dev/null || die "npm is needed to install the agents"
        log "installing @openai/codex@$CODEX_VERSION @anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" \
            "opencode-ai@$OPENCODE_VERSION into $AGENTS_HOME"
        mkdir -p "$AGENTS_HOME"
        [[ -f "$AGENTS_HOME/package.json" ]] || printf '{"name":"turnstream-agents","private":true}\n' >"$AGENTS_HOME/package.json"
        (cd "$AGENTS_HOME" && PATH="$NODE_HOME/bin:$PATH" npm install --no-audit --no-fund --loglevel=error \
            "@openai/codex@$CODEX_VERSION" "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" \
            "opencode-ai@$OPENCODE_VERSION" >&2) || die "npm install of the agents failed"
    fi
    for agent in codex claude opencode; do
        PATH="$NODE_HOME/bin:$PATH" "$BIN/$agent" --version >/dev/null || die "$agent was installed but does not run"
    done
}

need_installed() {
    [[ -x "$NODE_HOME/bin/node" && -x "$BIN/codex" && -x "$BIN/claude" && -x "$BIN/opencode" ]] \
        || die "the agents are not installed: run $0 install"
}

# Each agent's config in DIR, written once (DIR/home is the agent's HOME, DIR/work its working folder).
configure() {
    local agent="$1" dir="$2" base_url="$3"
    mkdir -p "$dir/home" "$dir/work"
    case "$agent" in
        codex)
            printf '%s\n' "$INSTRUCTIONS" >"$dir/instructions.md"
            cat >"$dir/home/config.toml" <<EOF
model = "policy"
model_provider = "turnstream"
model_instructions_file = "$dir/instructions.md"
include_permissions_instructions = false
include_apps_instructions = false
include_environment_context = false
include_collaboration_mode_instructions = false
web_search = "disabled"
approval_policy = "never"

[model_providers.turnstream]
name = "turnstream"
base_url = "$base_url/v1"
env_key = "TURNSTREAM_API_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0

[features]
multi_agent = false
goals = false
view_image = false
apps = false
plugins = false
hooks = false
image_generation = false
computer_use = false
browser_use = false
unbounded_connection_retries = false
EOF
            ;;
        opencode)
            cat >"$dir/work/opencode.json" <<EOF
{
  "\$schema": "https://opencode.ai/config.json",
  "provider": {
    "turnstream": {
      "npm": "@ai-sdk/openai-compatible",
      "name": "turnstream",
      "options": {"baseURL": "$base_url/v1", "apiKey": "{env:TURNSTREAM_API_KEY}"},
      "models": {"policy": {"name": "policy", "limit": {"context": 8192, "output": ${AGENTS_MAX_TOKENS:-256}}}}
    }
  },
  "model": "turnstream/policy",
  "small_model": "turnstream/policy",
  "autoupdate": false,
  "share": "disabled"
}
EOF
            ;;
        claude) ;;
    esac
}

turn() {
    [[ $# -ge 4 ]] || die "usage: $0 AGENT DIR BASE_URL MESSAGE [--again]"
    local agent="$1" dir="$2" base_url="$3" message="$4" again=false
    [[ "${5:-}" == "--again" ]] && again=true
    need_installed
    mkdir -p "$dir"
    dir="$(cd "$dir" && pwd)"
    [[ -d "$dir/home" ]] || configure "$agent" "$dir" "$base_url"
    export TURNSTREAM_API_KEY="${TURNSTREAM_API_KEY:-turnstream-local}"
    local timeout="${AGENTS_TIMEOUT:-300}" rc=0
    cd "$dir/work"
    case "$agent" in
        codex)
            local resume=(); $again && resume=(resume --last)
            HOME="$dir/home" CODEX_HOME="$dir/home" PATH="$NODE_HOME/bin:$PATH" timeout "$timeout" \
                "$BIN/codex" exec "${resume[@]}" --skip-git-repo-check "$message" </dev/null || rc=$?
            ;;
        claude)
            local more=(); $again && more=(--continue)
            HOME="$dir/home" ANTHROPIC_BASE_URL="$base_url" ANTHROPIC_API_KEY="$TURNSTREAM_API_KEY" \
                ANTHROPIC_MODEL=policy ANTHROPIC_SMALL_FAST_MODEL=policy CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 \
                CLAUDE_CODE_ATTRIBUTION_HEADER=0 CLAUDE_CODE_MAX_OUTPUT_TOKENS="${AGENTS_MAX_TOKENS:-256}" \
                MAX_THINKING_TOKENS=0 DISABLE_AUTO_COMPACT=1 PATH="$NODE_HOME/bin:$PATH" timeout "$timeout" \
                "$BIN/claude" -p "${more[@]}" --bare --system-prompt "$INSTRUCTIONS" --tools "" --strict-mcp-config \
                --disable-slash-commands "$message" </dev/null || rc=$?
            ;;
        opencode)
            # Word by word: opencode run quotes an argument holding spaces ("...") and sends the quotes along.
            local more=() words=(); $again && more=(--continue)
            read -ra words <<<"$message"
            HOME="$dir/home" XDG_CONFIG_HOME="$dir/home/.config" XDG_DATA_HOME="$dir/home/.local/share" \
                XDG_CACHE_HOME="$TURNSTREAM_CACHE/opencode-cache" PATH="$NODE_HOME/bin:$PATH" timeout "$timeout" \
                "$BIN/opencode" run "${more[@]}" "${words[@]}" </dev/null || rc=$?
            ;;
        *) die "unknown agent $agent (codex, claude or opencode)" ;;
    esac
    return "$rc"
}

case "${1:-}" in
    install) install ;;
    codex | claude | opencode) turn "$@" ;;
    path) need_installed; printf '%s\n' "$NODE_HOME/bin:$BIN" ;;
    *) die "usage: $0 install | codex|claude|opencode DIR BASE_URL MESSAGE [--again] | path" ;;
esac
